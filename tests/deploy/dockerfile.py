"""Just enough of a Dockerfile parser to replay this repository's Dockerfile in tests."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form CMD/ENTRYPOINT (or of HEALTHCHECK's CMD)."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text[text.index("CMD ") + 4 :]
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
        return value

    def flags(self) -> dict[str, str]:
        """Leading ``--name=value`` options (HEALTHCHECK, RUN --mount, COPY --from)."""
        return dict(re.findall(r"--([a-z-]+)=(\S+)", self.args.split(" CMD ")[0]))

    def env_pairs(self) -> dict[str, str]:
        """ENV key=value pairs (quotes removed, ``$VAR`` left for the caller)."""
        return dict(token.split("=", 1) for token in shlex.split(self.args))

    def shell_command(self) -> str:
        """A shell-form RUN's command without its leading ``--mount=...`` options."""
        return re.sub(r"^(?:--[a-z]+=\S+\s+)+", "", self.args)


@dataclass
class Stage:
    base: str
    name: str = ""
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"no {keyword} in stage {self.name or self.base}"
        return found[-1]


@dataclass
class Dockerfile:
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    @property
    def final_env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for ins in self.final.all("ENV"):
            env.update(ins.env_pairs())
        return env

    @property
    def cmd(self) -> list[str]:
        return self.final.last("CMD").exec_form()

    def absolute_paths(self) -> set[str]:
        """Absolute paths the build stage and the runtime ENV name (to map into a tmp dir)."""
        paths: set[str] = set()
        for ins in self.stages[0].instructions:
            if ins.keyword == "WORKDIR":
                paths.add(ins.args)
        if "VIRTUAL_ENV" in self.final_env:
            paths.add(self.final_env["VIRTUAL_ENV"])
        return paths


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        current += stripped
        if current:
            lines.append(current)
        current = ""
    if current:
        lines.append(current)
    return lines


def parse_dockerfile(path: Path) -> Dockerfile:
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text(encoding="utf-8")):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(base=parts[0], name=name))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, args))
    assert stages, f"{path}: no FROM"
    return Dockerfile(stages)
