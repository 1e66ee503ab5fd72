"""Driver side (the process that runs ``vtoken serve``, ``serve run`` or ``serve build``): the CLI, the
local Ray + Serve start, the ``serve build`` YAML, ``build_app``, and the multi-node ``ray start`` cluster
(``python -m vtoken.serve.launch.cluster``). Also imported by Serve's build task
for ``serve deploy``/KubeRay. No imports here; importing this package has no side effects."""
