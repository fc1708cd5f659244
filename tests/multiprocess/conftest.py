import sys
from pathlib import Path

# The tests here import the shared launcher as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
