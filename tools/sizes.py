"""The largest files and classes of a tree's ``ember/`` package: lines, and for a class its methods
and the attributes its methods assign (``self.x = …``, also in tuples and augmented).

    python tools/sizes.py [ROOT] [--top N]     # ROOT: a checkout (default: this one)
"""
from __future__ import annotations

import argparse
import ast
import pathlib


def classes(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attributes = set()
            for method in methods:
                for sub in ast.walk(method):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else []
                    for target in targets:
                        for leaf in ast.walk(target):
                            if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                                    and leaf.value.id == "self":
                                attributes.add(leaf.attr)
            yield node.name, node.end_lineno - node.lineno + 1, len(methods), len(attributes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=pathlib.Path(__file__).resolve().parents[1])
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    package = pathlib.Path(args.root) / "ember"
    files = sorted(package.rglob("*.py"))
    lengths = sorted(((len(f.read_text().splitlines()), f.relative_to(package.parent)) for f in files), reverse=True)
    print(f"{len(files)} files, {sum(n for n, _ in lengths)} lines; over 500 lines: "
          f"{sum(n > 500 for n, _ in lengths)}")
    for n, f in lengths[:args.top]:
        print(f"  {n:5d}  {f}")
    found = sorted(((lines, name, m, a, f.relative_to(package.parent)) for f in files
                    for name, lines, m, a in classes(f)), reverse=True)
    print("largest classes (lines, methods, attributes):")
    for lines, name, m, a, f in found[:args.top]:
        print(f"  {lines:5d} {m:3d} {a:3d}  {name} ({f})")


if __name__ == "__main__":
    main()
