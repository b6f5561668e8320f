"""Structured output: a request's JSON schema, regex, choice or grammar becomes a mask over the target's
vocabulary at every position it samples, computed by llguidance.

Split by who uses each part and when (docs/design.md §5.5):
    params.py   what a request asks (StructuredOutputsParams, strict mode's closed schemas): checked when the
                request is built, in the server process too; no llguidance, no torch
    grammar.py  compiling it (GrammarCompiler, once a request) into the matcher the request holds (Grammar),
                which Sequence.append advances with committed tokens
    masks.py    the step's sampler side: the grammar-forbidden tokens of each verify row as a logit bias
    drafts.py   the step's proposer side: drafts cut at the first forbidden token (before the verify), and
                a draft model drafting under the mask (DraftGuide)

Under speculation (docs/design.md §4.4) the mask of verify row j is the grammar's state after the output so
far and drafts[:j], each computed by walking the drafts and rolling back. The target's masked distribution is
what plain decoding samples from, so rejection sampling keeps the output exactly the constrained target's.
Nothing is imported here: each user imports the module it needs.
"""
