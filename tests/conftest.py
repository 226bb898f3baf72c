import os

# Tests run on the CPU unless a test is marked gpu and run on the device machine.
os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("JAXINFER_TEST_GPU") != "1" else "")
