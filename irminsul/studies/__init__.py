"""The paper's studies as commands (``irminsul study roc|sink|consistency``): each returns a typed
result, and writes ``<study>.json`` and ``<study>.png``. docs/studies.md describes them and the
figures they gave on the embedded model."""
