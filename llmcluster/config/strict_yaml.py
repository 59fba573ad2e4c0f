"""The one YAML loader of every file we read (job configs, cluster specs, plans, eval tasks, `--set` values).

PyYAML's SafeLoader keeps the last of two equal keys in a mapping without a word: a second `run:` in a job config
replaced the first and a run trained the default model (issue 64). This loader refuses it, naming the key and both
lines. Merge keys (`<<: *base`) still work: a key given next to a merge overrides the merged one on purpose, so
only keys written out twice count.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKey(ConstructorError):
    """A mapping names the same key twice. `problem` is the whole story in one line (no context lines)."""


class StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                try:
                    key = self.construct_object(key_node, deep=True)
                    hash(key)
                except (TypeError, ConstructorError):
                    continue   # an unhashable key: SafeLoader's own error says it
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKey(None, None, f"duplicate key {key!r} at line {line} (also at line "
                                       f"{seen[key]}): the last would silently win", key_node.start_mark)
                seen[key] = line
        return super().construct_mapping(node, deep)


def load(text: str) -> Any:
    """`yaml.safe_load(text)`, refusing duplicate keys (DuplicateKey, a yaml.YAMLError)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 -- a SafeLoader subclass
