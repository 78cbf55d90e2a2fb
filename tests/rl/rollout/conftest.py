import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: one thread is faster, and on a shared 2-core machine two threads spin-wait
    on each other (100x slower under load, measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _greedy_reference(model, prompt: list[int], max_tokens: int, stop: int | None = None
                      ) -> tuple[list[int], list[float]]:
    """Greedy decode recomputing the whole sequence every token (no cache, no engine): the tokens and their
    log-probs, ending after ``stop`` (the engine ends a request at its end-of-turn id) or at ``max_tokens``."""
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logp_V = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            t = int(logp_V.argmax())
            out.append(t)
            lps.append(float(logp_V[t]))
            ids.append(t)
            if t == stop:
                break
    return out, lps


@pytest.fixture
def greedy_reference():
    """``_greedy_reference``: what incremental decoding through the engine must equal."""
    return _greedy_reference
