"""The byte-level BPE vocabulary of the tiny test models and GGUF fixtures (GPT-2 byte mapping, two merges)."""


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


TOKENS = _bytes_to_unicode() + ["Ġt", "he", "<s>", "</s>"]
MERGES = ["Ġ t", "h e"]
TYPES = [1] * 258 + [3, 3]
VOCAB = len(TOKENS)  # 260
