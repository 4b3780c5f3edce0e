"""The SmolLM2 conversion takes its EOS from the GGUF, whatever transformers' GGUF reader makes of it: one release
(5.17, the GPU machine's) read ``<|im_start|>``, which made the converted model stop only at the next turn's start."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_misread_eos_is_replaced_by_the_ggufs():
    from transformers import AutoTokenizer

    from tools.smollm2 import gguf_eos_id, gguf_path, set_gguf_eos

    src = gguf_path()
    assert gguf_eos_id(src) == 2
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.eos_token = "<|im_start|>"  # what transformers 5.17 read
    assert tok.eos_token_id == 1
    set_gguf_eos(tok, src)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    set_gguf_eos(tok, src)  # already right: unchanged
    assert tok.eos_token_id == 2
