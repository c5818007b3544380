"""Modules over 450 lines and functions over 80 lines (issue #41's limits).

Run from the repository root: `python scripts/code_sizes.py [FOLDER ...]`. No output: within limits.
"""

import ast
import pathlib
import sys

roots = sys.argv[1:] or ["harness", "ring_impl", "scripts", "tests"]
for root in roots:
    for p in sorted(pathlib.Path(root).rglob("*.py")):
        src = p.read_text()
        n = src.count("\n")
        if n > 450:
            print(f"MODULE {p} {n}")
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                ln = node.end_lineno - node.lineno + 1
                if ln > 80:
                    print(f"FUNC {p}:{node.lineno} {node.name} {ln}")
