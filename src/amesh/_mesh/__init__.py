"""The parts behind :class:`~amesh.ProcMesh`: process lifecycle, supervision, and the
Host interface it starts its processes through (:mod:`._host`).

``amesh._proc_mesh.ProcMesh`` is the small user-facing facade over them.
"""
