"""Megatron-core learner backend (``learner.engine: megatron``).

``convert`` (HF <-> Megatron weights) is pure torch; ``engine`` needs megatron-core
(``pip install fleetrl[megatron]``, Python >= 3.12) and CUDA.
"""
