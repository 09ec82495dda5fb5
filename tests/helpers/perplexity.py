"""The reference perplexity: the loop of transformers' guide
(https://huggingface.co/docs/transformers/perplexity), run on a ``transformers`` model."""
import torch


def guide_perplexity(hf, ids, window: int, stride: int, *, wrong: str | None = None) -> tuple[float, int]:
    """(mean negative log-likelihood per predicted token, tokens predicted) of the ``transformers``
    causal LM ``hf`` on the token ids ``ids``, window by window as the guide computes it.

    Each window's loss is weighted by the targets its loss reads after transformers' internal shift
    (the labels from the second on that are not -100). The guide subtracts the batch size from the
    valid labels for that shift, one too many where the window's first label is -100 already
    (every window after the first when stride < window); what it means is the count here.
    A window that predicts nothing (a last window of one token) is left out: its loss is NaN.

    ``wrong`` computes a deliberately wrong variant, for negative controls: ``"all targets"``
    counts every target of each window (no -100, tokens predicted twice), ``"window means"``
    averages the windows' means.
    """
    input_ids = torch.as_tensor(ids)[None]  # (1, N)
    seq_len = input_ids.size(1)
    nll_sum, n_tokens, means, prev_end = 0.0, 0, [], 0
    for begin in range(0, seq_len, stride):
        end = min(begin + window, seq_len)
        trg_len = end - prev_end  # may be different from stride on the last window
        inputs = input_ids[:, begin:end]  # (1, T)
        targets = inputs.clone()  # (1, T)
        if wrong != "all targets":
            targets[:, :-trg_len] = -100
        predicted = int((targets[:, 1:] != -100).sum())  # (1, T - 1): the labels the shifted loss reads
        if predicted:
            with torch.no_grad():
                loss = hf(inputs, labels=targets).loss.item()
            nll_sum += loss * predicted
            n_tokens += predicted
            means.append(loss)
        prev_end = end
        if end == seq_len:
            break
    if wrong == "window means":
        return sum(means) / len(means), n_tokens
    return nll_sum / n_tokens, n_tokens
