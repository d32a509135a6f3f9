"""docs/course/weekN.md, the handouts: each names only exercises, figures and GUIDE questions that exist,
its points add up to the total it states (a "Going further" section's, 06's in week 2 and 07's in week 4,
to its extra credit), and every exercise of 01-07 is in one week. check() is pure (a handout's text in, its errors out), so
the planted test below feeds it a copy with a missing exercise id and shows the mistake is caught."""
import pathlib
import re

import pytest

import exercises

ROOT = pathlib.Path(__file__).resolve().parent.parent
COURSE = ROOT / "docs" / "course"
HANDOUTS = [COURSE / f"week{w}.md" for w in (1, 2, 3, 4)] + [COURSE / "final_project.md"]


def known_exercises():
    """Every exercise id the package grades, from its table (exercises.FILES / exercises.exercises)."""
    return {e.key for f in exercises.FILES for e in exercises.exercises(f)}


def guide_questions():
    """{'01': {1, 2, 3, 4}, ...}: the numbered items under each file's **Questions.** in docs/GUIDE.md."""
    out = {}
    for sec in re.split(r"\n## ", (ROOT / "docs" / "GUIDE.md").read_text())[1:]:
        if "**Questions.**" in sec:
            body = sec.split("**Questions.**", 1)[1].split("\n\n**", 1)[0]
            out[sec[:2]] = {int(n) for n in re.findall(r"^(\d+)\. ", body, re.M)}
    return out


def check(text, ids, questions):
    """The errors of one handout's text: unknown exercise ids, figures, GUIDE questions, a wrong total."""
    errors = []
    for i in re.findall(r"^\| (\d\d\.\d+) \|", text, re.M):
        if i not in ids:
            errors.append(f"exercise {i} does not exist (python3 -m exercises list)")
    for fig in re.findall(r"docs/figures/([\w.-]+)", text):
        if not (ROOT / "docs" / "figures" / fig).exists():
            errors.append(f"figure docs/figures/{fig} does not exist")
    for f, n in re.findall(r"GUIDE (\d\d) Q(\d+)", text):
        if int(n) not in questions.get(f, ()):
            errors.append(f"GUIDE {f} Q{n} is not a question of docs/GUIDE.md")
    # The week's own rows add up to its total; a "## Going further" section's (a later chapter's
    # exercises, optional) to its own extra credit, apart.
    required, further, extra = text.partition("\n## Going further")
    parts = [(required, re.search(r"\*\*Total: (\d+) points\.\*\*", required), "'**Total: N points.**'")]
    if further:
        parts.append((extra, re.search(r"\*\*Extra credit: (\d+) points\*\*", extra), "'**Extra credit: N points**'"))
    for part, total, line in parts:
        rows = [int(p) for p in re.findall(r"^\|[^|\n]+\|(?:[^|\n]+\|)? (\d+) \|", part, re.M)]
        if not total:
            errors.append(f"no {line} line")
        elif sum(rows) != int(total.group(1)):
            errors.append(f"the points add up to {sum(rows)}, not the stated {total.group(1)}")
    return errors


@pytest.mark.parametrize("path", HANDOUTS, ids=lambda p: p.name)
def test_handout_names_what_exists(path):
    text = path.read_text()
    assert check(text, known_exercises(), guide_questions()) == []
    if path.name.startswith("week"):
        assert re.search(r"^\| \d\d\.\d+ \|", text, re.M), "a week names no exercise"
        assert "<DUE DATE" in text and "## Rubric" in text and "## Deliverables" in text


def test_every_exercise_of_01_to_07_is_in_a_weeks_handout_with_its_points():
    # 01-05 in the weeks' own tables; 06 and 07 in "Going further" sections of weeks 2 and 4. A week's
    # points are what results.json gives (exercises' handout_points), so none may be named twice.
    named = [i for w in (1, 2, 3, 4) for i in re.findall(r"^\| (\d\d\.\d+) \|", (COURSE / f"week{w}.md").read_text(),
                                                         re.M)]
    assert len(named) == len(set(named)), named
    want = {e.key for f in exercises.FILES if f <= "07" for e in exercises.exercises(f)}
    assert want <= set(named), sorted(want - set(named))
    further = {w: (COURSE / f"week{w}.md").read_text().partition("\n## Going further")[2] for w in (2, 4)}
    assert re.findall(r"^\| (06\.\d) \|", further[2], re.M) == ["06.1", "06.2"]
    assert re.findall(r"^\| (07\.\d) \|", further[4], re.M) == ["07.1", "07.2"]


def test_planted_mistakes_are_caught(tmp_path):
    """A copy of week 1 naming a missing exercise, a missing figure, a missing question, a wrong total."""
    ids, qs = known_exercises(), guide_questions()
    text = (COURSE / "week1.md").read_text()
    for wrong, want in [(text.replace("| 01.4 |", "| 01.9 |"), "exercise 01.9 does not exist"),
                        (text.replace("f-and-g.svg", "f-and-h.svg"), "f-and-h.svg does not exist"),
                        (text.replace("GUIDE 01 Q4", "GUIDE 01 Q7"), "GUIDE 01 Q7 is not"),
                        (re.sub(r"Total: \d+", "Total: 1", text), "not the stated 1"),
                        ((COURSE / "week2.md").read_text().replace("| 06.2 |", "| 06.7 |"),
                         "exercise 06.7 does not exist"),
                        (re.sub(r"Extra credit: \d+", "Extra credit: 2", (COURSE / "week2.md").read_text()),
                         "not the stated 2")]:
        copy = tmp_path / "week1.md"
        copy.write_text(wrong)
        assert any(want in e for e in check(copy.read_text(), ids, qs)), want
