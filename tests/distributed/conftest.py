import sys
from pathlib import Path

# the worker scripts and helpers of this folder import each other by module name
sys.path.insert(0, str(Path(__file__).resolve().parent))
