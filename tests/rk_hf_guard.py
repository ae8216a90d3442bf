"""Imported first by the transformers tests: skips the importing test module where transformers is installed but
has turned its PyTorch half off (transformers 5 needs torch >= 2.6; reprokit accepts torch >= 2.4), since its
Trainer and models cannot be made there. A missing transformers stays an ImportError, not a skip: the test extra
installs it."""

import pytest
import torch
import transformers

if not transformers.utils.is_torch_available():
    pytest.skip(f"transformers {transformers.__version__} has disabled PyTorch on torch {torch.__version__} (it "
                "needs a newer one)", allow_module_level=True)
