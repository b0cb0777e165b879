"""Triton int8 kernels with their torch references (installed as ``verl_comm.kernels``)."""
