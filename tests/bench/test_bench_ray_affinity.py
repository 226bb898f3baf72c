"""The ray_affinity suite's workload (bench/ray_affinity.py): system prompts shared by their
questions, interleaved, of the asked length; distinct across systems."""
from bench.ray_affinity import workload


def test_the_workload_interleaves_questions_that_share_their_system_prompt():
    reqs = workload(systems=3, questions=4, chars=120, seed=0)
    assert len(reqs) == 12 and [s for s, _ in reqs[:3]] == [0, 1, 2]
    systems = {}
    for s, messages in reqs:
        system, user = messages
        assert system["role"] == "system" and user["role"] == "user"
        assert len(system["content"]) == 120
        systems.setdefault(s, set()).add(system["content"])
    assert all(len(v) == 1 for v in systems.values())
    assert len({next(iter(v)) for v in systems.values()}) == 3
    assert len({m[1]["content"] for _, m in reqs}) == 12
    assert workload(3, 4, 120, 0) == reqs
