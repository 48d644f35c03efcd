"""Safe YAML that refuses a mapping listing one key twice (plain YAML keeps the last entry silently).

``load_unique(text)`` is ``yaml.safe_load`` plus that rule, stated once for every file a person writes by hand: run
configs (:func:`hacrl_fed.config.load_config`, where ``security.roster`` listing an org twice would otherwise pin
the last key silently) and roster files (:func:`hacrl_fed.security.identity.load_roster`).
:class:`DuplicateKey` names where the mapping sits (``security.roster``), the key and the line of its second entry.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"  # ``<<: *anchor``: merges another mapping, not a key of its own


class DuplicateKey(ValueError):
    """A mapping that lists ``key`` twice; ``path`` is the dotted place of the mapping ("" at the top)."""

    def __init__(self, path: str, key: Any, line: int) -> None:
        super().__init__(f"{path + ': ' if path else ''}{key!r} is listed twice (line {line})")
        self.path, self.key, self.line = path, key, line


def load_unique(data: str | bytes) -> Any:
    """``yaml.safe_load(data)``, raising :class:`DuplicateKey` for a mapping that lists one key twice (anywhere)
    and ``yaml.YAMLError`` for text that is not YAML."""
    loader = yaml.SafeLoader(data)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(loader, node, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicates(loader: yaml.SafeLoader, node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias (possibly recursive): checked where it was anchored
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(loader, item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        keys: list[Any] = []
        for key_node, value in node.value:
            if key_node.tag == _MERGE_TAG:
                _refuse_duplicates(loader, value, path, seen)
                continue
            key = loader.construct_object(key_node, deep=True)
            if key in keys:
                raise DuplicateKey(path, key, key_node.start_mark.line + 1)
            keys.append(key)
            _refuse_duplicates(loader, value, f"{path}.{key}" if path else str(key), seen)
