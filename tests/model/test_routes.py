"""EngineConfig's backend-dependent defaults and the kernel routes chosen from them."""
import jax

from jaxinfer.config import EngineConfig
from jaxinfer.routes import Routes


def test_backend_defaults_dtype_and_warmup():
    cfg = EngineConfig()
    assert cfg.dtype == "auto"
    assert cfg.for_backend("gpu").dtype == "bfloat16"
    assert cfg.for_backend("cpu").dtype == "float32"
    assert EngineConfig(dtype="float32").for_backend("gpu").dtype == "float32"
    assert cfg.warmup is None and cfg.for_backend("gpu").warmup is True
    assert cfg.for_backend("cpu").warmup is False
    assert EngineConfig(warmup=True).for_backend("cpu").warmup is True


def test_engine_resolves_the_dtype_for_its_backend():
    from engine_util import tiny_engine
    engine = tiny_engine()
    assert engine.config.dtype == ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    assert engine.runner.engine.dtype == engine.config.dtype


def test_routes_by_backend_and_attention():
    gpu = Routes.choose(EngineConfig(), "gpu")
    assert gpu.pallas and not gpu.interpret and gpu.fused_glue and gpu.front_max_rows == 8
    assert gpu.decode_min_rows == gpu.min_gemm_rows == 8 and gpu.fp8_mlp and gpu.persistent_outputs
    cpu = Routes.choose(EngineConfig(), "cpu")
    assert cpu == Routes()
    assert not cpu.pallas and cpu.interpret and not cpu.fused_glue and cpu.decode_min_rows == 1
    interpreted = Routes.choose(EngineConfig(attention_impl="pallas"), "cpu")
    assert interpreted.pallas and interpreted.interpret and interpreted.fused_glue
    assert not interpreted.fp8_mlp and interpreted.decode_min_rows == 1
    assert not Routes.choose(EngineConfig(attention_impl="reference"), "gpu").fused_glue
    assert hash(gpu) != hash(cpu)      # static: a jit cache key


def test_only_gpu_steps_of_more_than_64_gemm_rows_compile_without_triton_gemms():
    gpu = Routes.choose(EngineConfig(), "gpu")
    off = {"xla_gpu_enable_triton_gemm": False}
    assert [gpu.compiler_options(rows) for rows in (1, 8, 64, 65, 512, 2048)] == \
        [{}, {}, {}, off, off, off]
    assert Routes.choose(EngineConfig(), "cpu").compiler_options(2048) == {}
    assert gpu.replace(triton_gemm_max_rows=0).compiler_options(2048) == {}
