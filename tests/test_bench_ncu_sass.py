"""bench.ncu_sass: the summary of an Nsight Compute SASS source page (CSV)."""
import csv
import gzip
import subprocess
import sys

from bench.ncu_sass import summarize

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "# Samples",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_wait (Not Issued)"]
ROWS = [["0x7f00000010", "      LDG.E R2, [R4.64]", "6", "6", "100", "6", "0", "0"],
        ["0x7f00000020", "  @P0 FMUL R3, R2, R2", "2", "2", "300", "0", "2", "2"],
        ["0x7f00000030", "      FMUL.FTZ R5, R3, R3", "0", "0", "100", "-", "0", "0"]]


def _write(path, opener=open):
    with opener(path, "wt", newline="") as f:
        f.write('"Kernel Name","k",\n')      # ncu's preamble lines come before the header
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(HEADER)
        w.writerows(ROWS)


def test_summary_counts_stalls_and_opcodes(tmp_path):
    _write(tmp_path / "s.csv")
    text = summarize(str(tmp_path / "s.csv"), top=2)
    lines = text.splitlines()
    assert lines[0] == "3 instructions, 500 executed (warp level), 8 samples"
    assert lines[1].split()[:3] == ["stall_long_sb", "6", "75.0%"]
    assert lines[2].split()[:3] == ["stall_wait", "2", "25.0%"]
    ops = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.startswith(("FMUL ", "LDG "))}
    assert ops["FMUL"] == ["80.0%", "25.0%"]      # predicated and suffixed forms together
    assert ops["LDG"] == ["20.0%", "75.0%"]
    assert lines[-2].split()[:3] == ["00010", "6", "100"]   # most samples first


def test_reads_gzip(tmp_path):
    _write(tmp_path / "s.csv.gz", gzip.open)
    assert summarize(str(tmp_path / "s.csv.gz")).startswith("3 instructions")


def test_help_prints_usage_without_reading_a_file():
    for args in ([], ["--help"]):
        r = subprocess.run([sys.executable, "-m", "bench.ncu_sass", *args],
                           capture_output=True, text=True)
        assert r.returncode == 1 and "source page" in r.stderr and "Traceback" not in r.stderr
