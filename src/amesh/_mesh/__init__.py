"""The parts behind :class:`~amesh.ProcMesh`: process lifecycle and supervision.

``amesh._proc_mesh.ProcMesh`` is the small user-facing facade over them.
"""
