"""Where the tests find the repository and their helpers, from any folder of tests/."""

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SUPPORT))
