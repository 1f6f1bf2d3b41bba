"""T5's attention masks from which positions hold a token, not from the token ids.

megatron-core's T5 dataset builds the local layers' masks from the ids (an id below 1 is
padding). A model whose decoder starts from id 0, as Hugging Face's T5 does (its decoder start
is the padding id), would then never attend to its first decoder position. Masks made from the
rows' lengths are right for both layouts, and equal to megatron-core's for ours.
"""

from __future__ import annotations

import torch


def attention_masks(
    encoder_valid: torch.Tensor, decoder_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(encoder, decoder, encoder-decoder) masks, [batch, 1, queries, keys], True where the
    local layers must not attend, from [batch, positions] masks of the real positions."""
    encoder = encoder_valid.bool()
    decoder = decoder_valid.bool()
    width = decoder.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=decoder.device).tril()
    both = encoder[:, :, None] & encoder[:, None, :]
    history = decoder[:, :, None] & decoder[:, None, :] & causal
    cross = decoder[:, :, None] & encoder[:, None, :]
    return ~both.unsqueeze(1), ~history.unsqueeze(1), ~cross.unsqueeze(1)
