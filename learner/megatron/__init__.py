"""Megatron-core learner backend (``learner.engine: megatron``).

``convert`` (HF <-> Megatron weights) and ``weights``' loading helpers are pure torch; ``engine``,
the gathers of ``weights``, ``checkpoint`` and ``patches`` (version-checked megatron-core patches)
need megatron-core (``pip install fleetrl[megatron]``, Python >= 3.12) and CUDA.
"""
