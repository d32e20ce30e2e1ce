"""The integer screens' inner loops as GCC compiles them: the kernel file at each ``--commits`` (``work``: the working
tree's) built with -O3 for this CPU (``native``) and for Sapphire Rapids (AMX's tile screen and its VNNI blocks), then
each block's loop (the backward jump around its vpdpbusd) counted from objdump: instructions, vpdpbusd, and stack
references (sums kept in memory).

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/loops.py --commits 71b4a1d work
"""
import argparse
import re
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from torch.utils.cpp_extension import include_paths

from jakiro_lib.models import kernels

ap = argparse.ArgumentParser()
ap.add_argument("--commits", nargs="+", default=["71b4a1d", "work"])
args = ap.parse_args()
flags = ["-O3", "-std=c++17", "-fopenmp", *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}"]
folder = Path(tempfile.mkdtemp())


def loops(listing: str, block: str) -> list[str]:
    rows = []
    for function in listing.split("\n\n"):
        head = re.search(rf"<void \(anonymous namespace\)::{block}<([^>]*)>", function.split("\n")[0])
        if not head:
            continue
        lines = [x for x in function.split("\n")[1:] if re.match(r"\s*[0-9a-f]+:", x)]
        for line in lines:
            jump = re.search(r"\sj\w+\s+([0-9a-f]+)\s<", line)
            if jump and int(jump.group(1), 16) < int(line.split(":")[0], 16):
                body = [x for x in lines if int(jump.group(1), 16) <= int(x.split(":")[0], 16) <= int(line.split(":")[0], 16)]
                dp = sum("vpdpbusd" in x for x in body)
                if dp:
                    stack = sum("rsp" in x or "rbp" in x for x in body)
                    rows.append(f"{block}<{head.group(1)}>: {len(body)} instructions, {dp} vpdpbusd, {stack} stack refs")
    return rows


for commit in args.commits:
    source = kernels.STREAM_SOURCE.read_text() if commit == "work" else subprocess.run(
        ["git", "show", f"{commit}:jakiro_lib/models/stream_gemm.cpp"], capture_output=True, text=True, check=True).stdout
    (folder / "k.cpp").write_text(source)
    for march, block in (("native", "signed_block"), ("sapphirerapids", "vnni_block")):
        subprocess.run(["g++", f"-march={march}", *flags, "-c", str(folder / "k.cpp"), "-o", str(folder / "k.o")],
                       check=True, capture_output=True)
        listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(folder / "k.o")], check=True,
                                 capture_output=True, text=True).stdout
        print(f"# {commit}, -march={march}")
        print("\n".join(loops(listing, block)), flush=True)
