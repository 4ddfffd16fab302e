"""Prints the binary directory of a CMake configure preset (so the Makefile has one source of truth)."""
import json
import pathlib
import sys

presets = json.loads((pathlib.Path(__file__).resolve().parent.parent / "CMakePresets.json").read_text())
by_name = {p["name"]: p for p in presets["configurePresets"]}
name = sys.argv[1]
if name not in by_name:
    sys.exit(f"unknown preset '{name}'; known: {', '.join(by_name)}")
preset = by_name[name]
while "binaryDir" not in preset:
    preset = by_name[preset["inherits"]]
print(preset["binaryDir"].replace("${sourceDir}/", ""))
