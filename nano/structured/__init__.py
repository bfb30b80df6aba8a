"""Structured output: grammars (JSON schema, any JSON object, regex, a choice of strings,
Lark) compiled by llguidance and applied as a logits processor's allowed-token mask, and a
chain that combines logits processors. The engine never imports it: it loads without
llguidance."""
from nano.structured.compose import Chain, chain
from nano.structured.grammar import Grammar, Vocabulary, grammar_source


def compile_grammar(vocabulary: Vocabulary, kind: str, value, strict: bool = True, name: str | None = None) -> Grammar:
    """A Grammar of one kind (grammar_source's kinds), or a one-line NanoError naming the problem."""
    return Grammar(vocabulary, grammar_source(kind, value, strict, name), name or kind)


__all__ = ["Chain", "Grammar", "Vocabulary", "chain", "compile_grammar", "grammar_source"]
