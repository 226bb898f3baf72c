"""One parse of the embedded SmolLM2 GGUF per test process: tests/conftest.py's
pytest_configure calls it, and so does the tensor-parallel test's child process, which runs
outside pytest (importing conftest there would apply its module-level settings again)."""


def share_the_embedded_gguf_parse():
    """Every reader of the embedded SmolLM2 GGUF (a read-only file in site-packages) in a test
    process gets one shared gguf.GGUFReader: the gguf package parses the file's ~100k
    tokenizer strings one field at a time, 3-5 s on the CPU per parse, and the same file is
    parsed again by every load: ours (checkpoints.gguf_loader.open_gguf) and transformers'
    (unshared, test_hf_parity.py alone would parse it 4 times, test_fp8_quality.py 5). Only
    the parse is shared: every load still builds its config, dequantized weights and
    tokenizer from the reader; the reader's arrays are read-only memory maps, so no load can
    change what the next one reads. Every other file (temporary GGUFs, missing or corrupt
    ones) gets a reader of its own; servers and CLI runs in child processes parse their own
    (the tensor-parallel test's child calls this itself)."""
    import threading
    from pathlib import Path

    from checkpoints import default_gguf_path

    try:
        import gguf        # not on the GPU machine, whose gpu-marked tests need no GGUF
        embedded = default_gguf_path().resolve()
    except Exception:      # the package or the model is not installed: nothing to share
        return
    reader_class, lock, parsed = gguf.GGUFReader, threading.Lock(), []

    def shared_reader(path, mode="r"):
        if mode != "r" or Path(path).resolve() != embedded:
            return reader_class(path, mode)
        with lock:
            if not parsed:
                parsed.append(reader_class(path, mode))
            return parsed[0]

    gguf.GGUFReader = shared_reader
