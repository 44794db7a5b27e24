"""How many prompt tokens a step may carry beside the streams: timed on this machine, not guessed.

A prompt chunk computed beside decodes makes their step, and so every stream's gap between two
tokens, longer. By how much depends on the machine: where a step is bound by reading the weights,
48 prompt tokens beside 16 decodes cost almost nothing; where arithmetic bounds it, they can
double the step, and a chunk that attends to a long context costs more again. So the pacer times
the steps: those with decodes only give the streams' own pace (per number of decodes, in powers
of two), those with prompt tokens how far they stretched it. The prompt tokens a step may add
beside decodes move toward what would have stretched it to `max_stretch` (a step's time taken as
linear in its prompt tokens): down at once after a step that went past it, up after one well
under it. The scheduler still gives prompts a floor beside decodes, so they always progress.
"""
from __future__ import annotations

SMOOTHING = 0.25  # weight of the newest decode-only step in the streams' pace


class Pacer:
    def __init__(self, max_stretch: float, most: int):
        """`max_stretch`: how many times a decode-only step's time a step with prompt chunks may
        take (0: untimed, `most` always); `most`: prompt tokens beside decodes at most (step_fill)."""
        self.max_stretch = max_stretch
        self.most = most
        self._alone: dict[int, float] = {}  # decodes' power of two -> seconds of a decode-only step
        self._allowed: dict[int, int] = {}  # decodes' power of two -> prompt tokens allowed beside

    def allowed(self, decodes: int) -> int:
        """Prompt tokens a step may add beside `decodes` decoding requests."""
        return self._allowed.get(decodes.bit_length(), self.most)

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """A step ran: `decodes` decoding rows and `prompt_tokens` prompt tokens in `seconds`."""
        if not self.max_stretch or not decodes or seconds <= 0:
            return
        key = decodes.bit_length()
        alone = self._alone.get(key)
        if not prompt_tokens:
            self._alone[key] = seconds if alone is None else (1 - SMOOTHING) * alone + SMOOTHING * seconds
            return
        if alone is None:
            return  # the streams' own pace is not known yet at this many decodes
        stretch = seconds / alone
        # t = alone * (1 + k * tokens): the tokens that would have taken max_stretch * alone
        target = prompt_tokens * (self.max_stretch - 1) / max(stretch - 1, 1e-3)
        allowed = self.allowed(decodes)
        if stretch > self.max_stretch:
            allowed = min(allowed, target)  # too long a gap: back at once
        else:
            allowed = (allowed + min(target, self.most)) / 2  # room left: halfway toward it
        self._allowed[key] = max(0, min(self.most, round(allowed)))
