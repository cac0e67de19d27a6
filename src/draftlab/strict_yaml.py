"""YAML that refuses a duplicated key, naming its dotted path and line.

yaml.safe_load keeps the last of two equal keys without a word; DVC's parser refuses them, so
draftlab's params files refuse them too: `yaml.load(text, Loader=UniqueKeyLoader)`."""

from __future__ import annotations

import yaml


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, line: int):
        super().__init__(key)
        self.key, self.line = key, line


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load keeps the last of two equal keys without a word; DVC's parser refuses
    them, so draftlab refuses them too, naming the dotted key and its line."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(".".join([*self._path(node), str(key)]), key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def _path(self, target) -> list[str]:
        """Dotted path of a mapping node inside the document (for the message)."""

        def walk(node, trail):
            if node is target:
                return trail
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    found = walk(v, [*trail, str(k.value)])
                    if found is not None:
                        return found
            return None

        return walk(self._root, []) or []

    def construct_document(self, node):
        self._root = node
        return super().construct_document(node)
