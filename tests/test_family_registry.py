"""Registry coverage: every registered model family, and every architecture it claims, has
tiny models that its parity tests build and check against transformers."""

from __future__ import annotations

from heron.core import PluginManager
from tests.hybrid_models import HYBRIDS
from tests.nllb_models import MODELS as NLLB
from tests.tiny_models import BARE, CLASSIFIERS, ENCODERS, FAMILIES, OWN_FORMS

#: family name -> (where its tiny models are declared, those models); each table's parity
#: test (tests/test_parity.py, tests/test_embeddings.py, tests/test_hybrid_parity.py,
#: tests/test_nllb_engine.py, tests/test_bert.py) runs every model in it.
FAMILY_TESTS = {
    "transformer": ("tests/tiny_models.py FAMILIES, BARE and CLASSIFIERS",
                    {**FAMILIES, **BARE, **CLASSIFIERS}),
    "gpt2": ("tests/tiny_models.py FAMILIES", FAMILIES),
    "hybrid_ssm": ("tests/hybrid_models.py HYBRIDS", HYBRIDS),
    "nllb": ("tests/nllb_models.py MODELS", NLLB),
    "bert": ("tests/tiny_models.py ENCODERS", ENCODERS),
}


def test_every_registered_family_has_parity_tests():
    pm = PluginManager()
    assert {"transformer", "hybrid_ssm"} <= set(pm.families)
    assert "gpt2" in pm.families, "the GPT-2 plugin is not installed: pip install ./plugin_template"
    for name, spec in pm.families.items():
        plugin = next(p.name for p in pm.plugins.values() if name in p.families)
        assert name in FAMILY_TESTS, (
            f"model family {name!r} (plugin {plugin!r}) has no parity tests: add tiny models "
            f"of its architectures {list(spec.architectures)} to a table of tests/ and an "
            f"entry for {name!r} to FAMILY_TESTS in {__name__.replace('.', '/')}.py")
        where, table = FAMILY_TESTS[name]
        tested = {model_cls.__name__ for model_cls, *_ in table.values()}
        tested |= {arch for arch, kind in OWN_FORMS.items() if kind in table}
        missing = [a for a in spec.architectures if a not in tested]
        assert not missing, (f"architectures {missing} of family {name!r} have no tiny model "
                             f"in {where}: add one")
        for kind, (model_cls, *_) in table.items():
            if model_cls.__name__ in spec.architectures:
                assert pm.family_for(architecture=model_cls.__name__) is spec, kind
