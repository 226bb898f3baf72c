"""jaxinfer's default XLA flag (programmatic dependent launch, jaxinfer/__init__.py)."""
import os
import subprocess
import sys

import jaxinfer
from jaxinfer import PDL_FLAG, _default_xla_flags


def test_pdl_flag_added_to_existing_flags():
    env = {"XLA_FLAGS": "--xla_gpu_autotune_level=2"}
    _default_xla_flags(env)
    assert env["XLA_FLAGS"] == f"--xla_gpu_autotune_level=2 {PDL_FLAG}"
    env = {}
    _default_xla_flags(env)
    assert env["XLA_FLAGS"] == PDL_FLAG


def test_user_choice_wins():
    env = {"XLA_FLAGS": "--xla_gpu_enable_pdl=false"}
    _default_xla_flags(env)
    assert env["XLA_FLAGS"] == "--xla_gpu_enable_pdl=false"


def test_import_sets_it_before_jax_starts():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("import os, jaxinfer, jax; print(os.environ['XLA_FLAGS']); "
            "print(float(jax.numpy.ones(3).sum()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(jaxinfer.__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [PDL_FLAG, "3.0"]   # the CPU backend takes the flag
