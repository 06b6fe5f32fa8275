from pathlib import Path

#: The repository's root (test modules sit one or two folders below tests/).
REPO_ROOT = Path(__file__).resolve().parent.parent
