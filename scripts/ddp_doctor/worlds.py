"""Scripts that make several process groups one after another (``init_process_group``, ``destroy_process_group``,
``init_process_group`` again): the recorder keeps each earlier world's facts in ``worlds`` and starts the next
afresh, and here each earlier world gets every rule on its own (issue 54 item 4). No rule ever sees the records of
two worlds at once; a finding of an earlier world says which it was."""


def check_earlier(records: dict, nproc: int, rules, facts) -> None:
    """``rules(records, facts, nproc)`` on each world made before the last one; its findings are added to ``facts``
    (a kind of mistake the report has already is not added twice), told as found in that process group."""
    count = max((len(rec.get("worlds", [])) for rec in records.values()), default=0)
    if not count:
        return
    first = next(rec["worlds"][0]["pg"] for rec in records.values() if rec.get("worlds"))
    facts.checked.append(f"each of the {count + 1} process groups the script made one after another on its own "
                         f"(the first at {first.get('where') or '?'})")
    for i in range(count):
        then = {r: {**rec, **rec["worlds"][i]["facts"], "pg": rec["worlds"][i]["pg"]}
                for r, rec in records.items() if len(rec.get("worlds", [])) > i}
        found = type(facts)(facts.cwd)
        rules(then, found, nproc)
        for finding in found.findings:
            finding.evidence = f"in process group {i + 1} of {count + 1}: {finding.evidence}"
            facts.add(finding)
        facts.unchecked += [f"in process group {i + 1} of {count + 1}: {line}" for line in found.unchecked
                            if line not in facts.unchecked]
