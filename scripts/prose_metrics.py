"""Prose and density figures of the code, as issue #41 measured them.

Docstrings and comments: words per sentence, parentheses and semicolons per 100 words, the share of
docstring lines in module docstrings. Code: the share of lines over 100 columns, and conditional
expressions per 1,000 lines, and how many hold another. Run from the repository root: `python scripts/prose_metrics.py`.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import sys
import tokenize
from collections import Counter

# a sentence ends at . ! ? before a capital or a parenthesis, or at a blank line
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])|\n\s*\n")
DOC_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstrings(tree: ast.AST) -> list[tuple[bool, str]]:
    """(is a module docstring, its text) of every docstring in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, DOC_OWNERS):
            text = ast.get_docstring(node, clean=True)
            if text:
                out.append((isinstance(node, ast.Module), text))
    return out


def comments(src: str) -> list[str]:
    """The text of every comment in `src`."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                out.append(tok.string.lstrip("#").strip())
    except tokenize.TokenError:
        pass
    return out


def measure(path: pathlib.Path, n: Counter) -> None:
    """Add one file's counts to `n`."""
    src = path.read_text()
    tree = ast.parse(src)
    texts = []
    for is_module, text in docstrings(tree):
        lines = text.count("\n") + 1
        n["doc_lines"] += lines
        n["module_doc_lines"] += lines if is_module else 0
        texts.append(text)
    for text in texts + comments(src):
        text = re.sub(r"`[^`]*`", "X", text)
        for sentence in SENTENCE_END.split(text):
            words = len(sentence.split())
            if words >= 3:
                n["words"] += words
                n["sentences"] += 1
        n["parens"] += text.count("(")
        n["semicolons"] += text.count(";")
    lines = src.splitlines()
    n["lines"] += len(lines)
    n["code_lines"] += sum(1 for line in lines if line.strip())
    n["long_lines"] += sum(1 for line in lines if len(line) > 100)
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp):
            n["ifexp"] += 1
            n["nested_ifexp"] += any(
                isinstance(m, ast.IfExp) for m in ast.walk(node) if m is not node
            )


def main(roots: list[str]) -> None:
    n: Counter = Counter()
    for root in roots or ["harness", "ring_impl"]:
        for path in pathlib.Path(root).rglob("*.py"):
            # the flash-attn stand-in copies flash-attn's own docstrings
            if "standin" not in str(path):
                measure(path, n)
    words = max(n["words"], 1)
    print(
        f"words/sentence {n['words'] / max(n['sentences'], 1):.1f}; "
        f"parens/100w {100 * n['parens'] / words:.1f}; "
        f"semicolons/100w {100 * n['semicolons'] / words:.1f}; "
        f"module-docstring share {100 * n['module_doc_lines'] / max(n['doc_lines'], 1):.0f}%; "
        f"lines>100 {100 * n['long_lines'] / max(n['code_lines'], 1):.1f}%; "
        f"ifexp/1000 lines {1000 * n['ifexp'] / max(n['lines'], 1):.1f} ({n['nested_ifexp']} nested)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
