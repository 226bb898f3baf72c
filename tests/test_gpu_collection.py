"""The README's GPU command (`-m gpu`) collects only the files that hold gpu-marked tests
(conftest.skipped_in_gpu_runs): the GPU machine lacks packages some other files import."""
from pathlib import Path

from conftest import skipped_in_gpu_runs

HERE = Path(__file__).resolve().parent


def suite_file(name: str) -> Path:
    return next(HERE.rglob(name))


def test_gpu_runs_leave_out_files_without_gpu_tests(tmp_path):
    plain, marked = tmp_path / "test_plain.py", tmp_path / "test_marked.py"
    plain.write_text("import gguf\n\ndef test_a():\n    pass\n")
    marked.write_text("import pytest\n\n@pytest.mark.gpu\ndef test_b():\n    pass\n")
    assert skipped_in_gpu_runs(plain, "gpu") and skipped_in_gpu_runs(plain, " gpu ")
    assert not skipped_in_gpu_runs(marked, "gpu")
    for expr in ("not gpu", "", "gpu or slow"):       # anything else collects every file
        assert not skipped_in_gpu_runs(plain, expr)
    assert not skipped_in_gpu_runs(tmp_path, "gpu")    # a directory is walked, never left out


def test_the_suites_gpu_files_are_kept():
    """The files the GPU machine cannot import hold no gpu test; the kernels' files do."""
    for name in ("test_tokenizer.py", "test_checkpoints.py", "test_serve.py",
                 "test_serve_lifecycle.py"):
        assert skipped_in_gpu_runs(suite_file(name), "gpu"), name
    for name in ("test_paged_attention.py", "test_fp8_matmul.py", "test_model_glue.py"):
        assert not skipped_in_gpu_runs(suite_file(name), "gpu"), name
