"""The checks of 02's exercises (exercises/ex02_pipeline_1f1b.py), and the planted wrong answers.

02.1 and 02.2 are the lesson's loops, gpipe_step and one_f_one_b_step. Each runs on CPU ranks, one
stage a rank (02's stage_model, the serial model's weights), float64, on a batch whose
microbatches count unequal numbers of targets (plumbing.reference.unequal_counts: microbatch 0
none), and the loss and every gradient are compared with the serial model's (1e-10): for GPipe at
pp = 3, m = 4; for 1F1B at pp = 4, m = 6 (a steady state) and m = 2 (a warm-up cut at m). The tied
embedding is summed by the grader during these two (02's machine's sync_tied_embeddings, in place
of the lesson's sum_tied_grads, which is 02.3's), so that each exercise is graded alone; the
grader counts that the loop called it. While the loop runs, the lesson's pieces it calls
(pipeline.forward_step, backward_step, recv_from, send_recv) are watched: each forward and backward
must come where the schedule's list (02's machine: gpipe, one_f_one_b) puts it, and a receive
that the schedule would not yet post (a gradient awaited during a warm-up too short: two
neighbours then wait for each other) stops the rank at once, saying so, instead of a deadlock.
Nothing expected is taken from the lesson's own gpipe_step or one_f_one_b_step (the student copy
replaces them by the stubs): the answer is the serial model's, the order the machine's lists'.

The tied embedding's sum (02.3) is checked on the machine: 02's executor runs 1F1B's lists on 2
ranks and on 1, the student's sum_tied_grads then sums the copies, against the serial model.
"""
import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Mistake, Planted, differences, first, installed, new_group, numbered, \
    random_weights, ranks, token_batch

tensor_parallel = numbered("01_tensor_parallel")
pipeline = numbered("02_pipeline_1f1b")
F64 = torch.float64
ROWS, T = 2, 8  # each microbatch: (ROWS, T) tokens
REFERENCE = {"gpipe_step": pipeline.gpipe_step, "one_f_one_b_step": pipeline.one_f_one_b_step,
             "sum_tied_grads": pipeline.sum_tied_grads}
WHAT = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}


def pipeline_cfg(n_layer):
    return tensor_parallel.GPTConfig(vocab_size=97, block_size=T, n_layer=n_layer, n_head=2, n_embd=16)


def name(a):
    return str(a) if isinstance(a, pipeline.Action) else repr(a)


def serial_reference(n_layer, m, seed=7, unequal=False):
    """The serial model's loss and gradients on m microbatches of (ROWS, T) tokens: uneven counted
    targets (5 masked in row 0), or with unequal, unequal_counts' (microbatch 0 counting none)."""
    from plumbing.reference import unequal_counts
    cfg = pipeline_cfg(n_layer)
    full = random_weights(cfg, seed)
    idx, targets = token_batch(cfg, ROWS * m, T, seed + 1, ignored=5)
    if unequal:
        unequal_counts(targets, m)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=F64)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    return dict(cfg=cfg, full=full, idx=idx, targets=targets, m=m, loss=loss.detach(),
                grads={n: p.grad for n, p in serial.named_parameters()})


# ----------------------------------------------------------------------------------------------
# Watching a lesson loop: the order of its actions and of its receives, against the schedule's list


class Watch:
    """This rank's actions as the loop runs them, against `expected`, the schedule's list here
    [(kind, chunk, mb)]. A loop that leaves it raises Mistake at once (one line: the rank's place in
    the schedule, and why that is wrong), before a wrong receive can make two ranks wait forever."""

    def __init__(self, schedule, rank, pp, expected, chunks, microbatches):
        self.schedule, self.rank, self.pp, self.expected = schedule, rank, pp, expected
        self.chunks, self.microbatches, self.done, self.outputs = chunks, microbatches, [], {}
        self.sent = None  # 02's loops: {"F": outputs sent to stage s + 1, "B": input gradients sent to s - 1}
        self.neighbours = {}  # 02's loops: {stage s -+ 1: its list}, to say what it needs from here

    def count(self, kind):
        return sum(a[0] == kind for a in self.done)

    def place(self):
        f, b = self.count("F"), self.count("B")
        return f"after {f} forward{'s' * (f != 1)} and {b} backward{'s' * (b != 1)}"

    def act(self, kind, chunk, mb):
        k, what = len(self.done), f"{'F' if kind == 'F' else 'B'}{mb}" + (f".{chunk}" if chunk else "")
        want = self.expected[k] if k < len(self.expected) else None
        if (kind, chunk, mb) != want:
            raise Mistake(f"{self.place()}: its action number {k} is {what}, where {WHAT[self.schedule]} runs "
                          + ("nothing more" if want is None else f"{want[0]}{want[2]}" + (f".{want[1]}" if want[1]
                                                                                            else ""))
                          + " there: " + self.why(kind, want))
        self.done.append((kind, chunk, mb))

    def why(self, kind, want):
        """What a wrong action usually means, per schedule."""
        s, pp, f = self.rank, self.pp, self.count("F")
        if self.schedule == "gpipe":
            return ("GPipe runs every forward first, then the backwards in the same order, microbatch 0 first"
                    if kind == "B" else "GPipe runs each microbatch forward once, in order")
        if self.schedule == "1f1b":
            warm = min(pp - s - 1, len(self.microbatches))
            if want is not None and want[0] == "F" and kind == "B":
                return (f"warm-up too short: stage {s} runs pp - stage - 1 = {pp - s - 1} warm-up forwards (at most "
                        f"m), then one steady forward, before its first backward")
            if want is not None and want[0] == "B" and kind == "F":
                return (f"warm-up too long, or a steady forward without its backward: stage {s} runs {warm} warm-up "
                        f"forwards, then alternates; at most pp - stage = {pp - s} microbatches in flight (here "
                        f"{f - self.count('B') + 1})")
            return "1F1B runs forwards in order and backwards oldest first"
        return self.interleaved_why(kind, want)

    def interleaved_why(self, kind, want):
        pp, v, s = self.pp, len(self.chunks), self.rank
        warm = min(2 * (pp - s - 1) + (v - 1) * pp, v * len(self.microbatches))
        if want is not None and want[0] != kind:
            return (f"warm-up too {'short' if kind == 'B' else 'long'}: rank {s} runs 2 (pp - rank - 1) + (v - 1) pp "
                    f"= {warm} warm-up forwards (at most m v), then steady forward-backward pairs")
        return (f"the interleaved order (03's chunk_and_microbatch): groups of pp = {pp} microbatches go through "
                f"chunk 0, then chunk 1, ... (backwards: chunk v - 1 first), then the next group")

    def awaits(self, kind, chunk, mb, pending=0):
        """Before a receive: the input of forward (kind "F") or the output gradient of backward ("B")
        (chunk, mb), with `pending` forwards of the same step that will run first (03's steady pair).
        The schedule posts it only after the other kind's actions listed before it have run."""
        if (kind, chunk, mb) not in self.expected:
            what = f"microbatch {mb}'s " + ("input" if kind == "F" else "output gradient")
            raise Mistake(f"{self.place()}: it waits for {what}, which {WHAT[self.schedule]} never receives here "
                          f"(m = {len(self.microbatches)}, microbatches 0 to {len(self.microbatches) - 1}): nothing "
                          f"will send it, and the rank would wait forever (the last steady step sends its input "
                          f"gradient alone, with pipeline.send_to)")
        p = self.expected.index((kind, chunk, mb))
        other = "B" if kind == "F" else "F"
        need, have = sum(a[0] == other for a in self.expected[:p]), self.count(other) + (pending if kind == "B" else 0)
        if have < need:
            what = f"microbatch {mb}'s " + ("input" if kind == "F" else "output gradient") + \
                (f" on chunk {chunk}" if len(self.chunks) > 1 else "")
            raise Mistake(f"{self.place()}: it waits for {what}, which {WHAT[self.schedule]} receives only after "
                          f"{need} {'backward' if other == 'B' else 'forward'}{'s' * (need != 1)} "
                          + ("(the neighbour would wait too: a deadlock): " if kind == "B" else "(one microbatch too many in flight): ") + (self.why("B", ("F",)) if kind == "B" else
                                                                               self.why("F", ("B",))))
        peer = self.rank + (1 if kind == "B" else -1)
        if self.sent is None or not 0 <= peer < self.pp:
            return
        theirs = self.neighbours[peer]  # 02's loops: what the neighbour must have from here before it sends this
        theirs_need = sum(a[0] == other for a in theirs[:theirs.index((kind, chunk, mb))])
        if self.sent[other] < theirs_need:
            thing = "output" if kind == "B" else "input gradient"
            raise Mistake(f"{self.place()}: it waits for microbatch {mb}'s {'output gradient' if kind == 'B' else 'input'} "
                          f"from stage {peer} having sent it only {self.sent[other]} {thing}"
                          f"{'s' * (self.sent[other] != 1)} of the {theirs_need} that stage needs first: both would "
                          f"wait (a deadlock): send first, or send and receive at once with pipeline.send_recv")

    def which(self, mb):
        return next((i for i, b in enumerate(self.microbatches) if b is mb or b[0] is mb[0]), None)

    def lesson_pieces(self, messages=True):
        """Replacements for 02's forward_step and backward_step, and (messages: 02's loops) recv_from, send_to
        and send_recv, that record and check."""
        real_f, real_b, real_recv, real_sr = pipeline.forward_step, pipeline.backward_step, pipeline.recv_from, \
            pipeline.send_recv
        chunk_of = lambda stage: next((c for c, x in enumerate(self.chunks) if x is stage), 0)  # noqa: E731

        def forward_step(stage, mb, x, weight, losses):
            c, i = chunk_of(stage), self.which(mb)
            self.act("F", c, i)
            out = real_f(stage, mb, x, weight, losses)
            self.outputs[id(out[1])] = (c, i, out[1])
            return out

        def backward_step(x, y, dy):
            c, i, _ = self.outputs.get(id(y), (0, None, None))
            self.act("B", c, i)
            return real_b(x, y, dy)

        def awaited(peer):  # 02's loops: a gradient from stage s + 1 is the oldest's, an input the next's
            if 0 <= peer < self.pp and peer != self.rank:
                if peer == self.rank + 1:
                    self.awaits("B", 0, self.count("B"))
                else:
                    self.awaits("F", 0, self.count("F"))

        def sending(peer):
            if 0 <= peer < self.pp and peer != self.rank and self.sent is not None:
                self.sent["F" if peer == self.rank + 1 else "B"] += 1

        def recv_from(src, like, pp_group=None):
            awaited(src)
            return real_recv(src, like, pp_group)

        def send_to(t, dst, pp_group=None):
            sending(dst)
            return real_send(t, dst, pp_group)

        def send_recv(t, peer, like, pp_group=None):  # the send and the receive at once: the send counts first
            sending(peer)
            awaited(peer)
            return real_sr(t, peer, like, pp_group)

        real_send, pieces = pipeline.send_to, [(pipeline, "forward_step", forward_step),
                                               (pipeline, "backward_step", backward_step)]
        if not messages:
            return pieces
        self.sent = {"F": 0, "B": 0}
        return pieces + [(pipeline, "recv_from", recv_from), (pipeline, "send_to", send_to),
                         (pipeline, "send_recv", send_recv)]


def summed_by_the_grader(chunks_of, embed_group, calls):
    """A stand-in for the lesson's sum_tied_grads (02.3's): 02's machine's sync_tied_embeddings over
    the embedding group, the call counted. chunks_of(stage): the rank's chunks holding a copy."""
    def sum_tied_grads(stage, pp_group=None):
        calls.append(1)
        pipeline.sync_tied_embeddings(chunks_of(stage), embed_group)
    return sum_tied_grads


def compared(env, loss, chunks, ref, calls, last):
    """This rank's loss (on the last rank) and every gradient against the serial model's."""
    pairs = []
    if last:
        pairs = [("the loss", loss, ref["loss"])] if loss is not None else []
        if loss is None:
            return [f"rank {env.rank}: the last stage returned None: it returns the step's loss (the weighted means' "
                    f"sum)"]
    means = _means_mean(ref)
    if last and loss is not None and means is not None and abs(float(loss) - means) <= 1e-10 * abs(means):
        return [f"rank {env.rank}: the loss is the mean of the microbatches' means (1/m each), not the batch's mean "
                f"over its counted targets: weigh each microbatch by pipeline.loss_weights(microbatches) (weights "
                f"None)"]
    pairs += [(f"the gradient of {n}", p.grad, ref["grads"][n]) for c in chunks for n, p in c.named_parameters()]
    out = [f"rank {env.rank}: {r}" for r in differences(pairs, factors={"m": ref["m"]})]
    if out and not calls and env.world_size > 1 and any("wte" in c.transformer for c in chunks):
        out.insert(0, f"rank {env.rank}: the step never called pipeline.sum_tied_grads(stage, pp_group): the copies "
                      f"of the tied embedding (first and last stage) each hold only their own part of the gradient")
    return out


def _means_mean(ref):
    """The loss a loop weighing each microbatch 1/m would give (None when it is the right one)."""
    m, tm = ref["m"], ref.setdefault("means", None)
    if tm is None:
        serial = tensor_parallel.GPT(ref["cfg"], None, init=False, dtype=F64).load_full_state_dict(ref["full"])
        with torch.no_grad():
            losses = [serial(i, t)[1] for i, t in zip(ref["idx"].chunk(m), ref["targets"].chunk(m))]
        tm = ref["means"] = float(sum(torch.nan_to_num(x) for x in losses) / m)
    return None if abs(tm - float(ref["loss"])) <= 1e-12 else tm


# ----------------------------------------------------------------------------------------------
# 02.1 and 02.2: the lesson's loops on CPU ranks, against the serial model


def _lesson(env, step, schedule, ref):
    pp, s, m = env.world_size, env.rank, ref["m"]
    embed_group = new_group([0, pp - 1]) if pp > 1 else None
    stage = pipeline.stage_model(ref["cfg"], dtype=F64).load_full_state_dict(ref["full"])
    micro = list(zip(ref["idx"].chunk(m), ref["targets"].chunk(m)))
    lists = {"gpipe": pipeline.gpipe, "1f1b": pipeline.one_f_one_b}[schedule]
    listed = [[(a.kind, a.chunk, a.mb) for a in lists(pp, m, r)] for r in range(pp)]
    watch = Watch(schedule, s, pp, listed[s], [stage], micro)
    watch.neighbours = {r: listed[r] for r in (s - 1, s + 1) if 0 <= r < pp}
    calls = []
    with installed(*watch.lesson_pieces(), (pipeline, "sum_tied_grads",
                                            summed_by_the_grader(lambda st: [st], embed_group, calls))):
        loss = step(stage, micro)
    left = watch.expected[len(watch.done):]
    if left and watch.done:  # none watched: the loop does its arithmetic and messages itself (serial decides)
        return [f"rank {s}: the step ended after {len(watch.done)} actions; {WHAT[schedule]} runs {len(watch.expected)} "
                f"(every microbatch forward and backward once): {left[0][0]}{left[0][2]} never ran"]
    return compared(env, loss, [stage], ref, calls, s == pp - 1)


def run_lesson(step, schedule, pp, m):
    ref = serial_reference(pp, m, unequal=True)
    where = f"pp={pp}, m={m}, {WHAT[schedule]} on {pp} CPU ranks, one stage each, against the serial model: "
    return first(diagnoses_first([where + r for rs in ranks(_lesson, pp, step, schedule, ref) for r in rs]), 3)


def diagnoses_first(reasons):
    """Every rank's reasons, each said once, a diagnosis (a reason that is not a raw tensor difference) first."""
    unique = list(dict.fromkeys(reasons))
    return sorted(unique, key=lambda r: ": the gradient of " in r or ": the loss " in r and " is off by " in r)


def check_gpipe_step(impl):
    return run_lesson(impl["gpipe_step"], "gpipe", 3, 4)


def check_one_f_one_b_step(impl):
    for m in (6, 2):  # a steady state; a warm-up cut at m (stages 0 and 1 never reach it)
        bad = run_lesson(impl["one_f_one_b_step"], "1f1b", 4, m)
        if bad:
            return bad
    return []


# ----------------------------------------------------------------------------------------------
# 02.3 The tied embedding, summed after 02's machine has run 1F1B's lists


def _tied(env, ref):
    """1F1B's lists through 02's executor on this rank's stage, then the sum_tied_grads installed (the
    student's); the copy's gradient before the sum is kept, to say what a wrong one holds."""
    pp = env.world_size
    stage = pipeline.stage_model(ref["cfg"], dtype=F64).load_full_state_dict(ref["full"])
    micro = list(zip(ref["idx"].chunk(ref["m"]), ref["targets"].chunk(ref["m"])))
    schedule = pipeline.Schedule([pipeline.one_f_one_b(pp, ref["m"], s) for s in range(pp)])
    loss = pipeline.execute(schedule, [stage], dist.group.WORLD, micro, pipeline.Wire((ROWS, T, ref["cfg"].n_embd))).loss
    key = "transformer.wte.weight"
    own = stage.transformer.wte.weight.grad.clone() if "wte" in stage.transformer else None
    pipeline.sum_tied_grads(stage, None)
    pairs = [("the loss", loss, ref["loss"])] if loss is not None else []
    for n, p in stage.named_parameters():
        if n == key:
            part = "the lookup's" if stage.pre_process and pp > 1 else "the output layer's" if pp > 1 else "both uses'"
            pairs.append((f"rank {env.rank}'s copy of {key}", p.grad, ref["grads"][key],
                          [(own, f"it holds only its own part of the gradient ({part}): add the other "
                                 f"stage's part (send_recv with the stage at the other end)"),
                           (ref["grads"][key] - own, "it holds only the other stage's part: add it to "
                                                     "this copy's own gradient, do not replace it")]))
        else:
            pairs.append((f"the gradient of {n}", p.grad, ref["grads"][n]))
    return [f"rank {env.rank}: {r}" for r in differences(pairs, factors={"2": 2})]


def check_sum_tied_grads(impl):
    reasons = []
    with installed((pipeline, "sum_tied_grads", impl["sum_tied_grads"])):
        for pp in (2, 1):  # two stages, each a copy; one stage holding both uses in one weight
            reasons += [f"pp={pp}: {r}" for rs in ranks(_tied, pp, serial_reference(2, 4)) for r in rs]
            if reasons:
                break
    return first(reasons, 3)


# ----------------------------------------------------------------------------------------------
# Planted wrong answers: the lesson's loops, each with one thing changed


def _gpipe_planted(newest_first=False, tied=True, means=False):
    def gpipe_step(stage, microbatches, pp_group=None, weights=None):
        s, m, g, losses, flight = dist.get_rank(pp_group), len(microbatches), pp_group, [], []
        w = [1 / m] * m if means else weights or pipeline.loss_weights(microbatches)
        out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)
        for i, mb in enumerate(microbatches):
            flight.append(pipeline.forward_step(stage, mb, pipeline.recv_from(s - 1, out, g), w[i], losses))
            pipeline.send_to(flight[-1][1], s + 1, g)
        while flight:
            x, y = flight.pop(-1 if newest_first else 0)
            pipeline.send_to(pipeline.backward_step(x, y, pipeline.recv_from(s + 1, out, g)), s - 1, g)
        if tied:
            pipeline.sum_tied_grads(stage, g)
        return sum(losses) if stage.post_process else None
    return gpipe_step


def _one_f_one_b_planted(warmup_of=lambda pp, s: pp - s - 1, past_end=False):
    """1F1B's loops with another warm-up, warmup_of(pp, stage) between 0 and m; or (past_end) a steady
    state whose last step also waits for a next microbatch's input, which never comes."""
    def one_f_one_b_step(stage, microbatches, pp_group=None, weights=None):
        s, pp, m, g = dist.get_rank(pp_group), dist.get_world_size(pp_group), len(microbatches), pp_group
        w, losses, flight = weights or pipeline.loss_weights(microbatches), [], []
        out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)
        warmup = max(0, min(warmup_of(pp, s), m))
        for i in range(warmup):
            flight.append(pipeline.forward_step(stage, microbatches[i], pipeline.recv_from(s - 1, out, g), w[i], losses))
            pipeline.send_to(flight[-1][1], s + 1, g)
        x = pipeline.recv_from(s - 1, out, g) if warmup < m else None
        for i in range(warmup, m):
            flight.append(pipeline.forward_step(stage, microbatches[i], x, w[i], losses))
            dy = pipeline.send_recv(flight[-1][1], s + 1, out, g)
            dx = pipeline.backward_step(*flight.pop(0), dy)
            if i + 1 < m or past_end:
                x = pipeline.send_recv(dx, s - 1, out, g)
            else:
                pipeline.send_to(dx, s - 1, g)
        while flight:
            x, y = flight.pop(0)
            pipeline.send_to(pipeline.backward_step(x, y, pipeline.recv_from(s + 1, out, g)), s - 1, g)
        pipeline.sum_tied_grads(stage, g)
        return sum(losses) if stage.post_process else None
    return one_f_one_b_step




def _sum_nothing(stage, pp_group=None):
    pass


def _swap_not_add(stage, pp_group=None):  # each end takes the other's part instead of adding it
    s, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    if pp > 1 and s in (0, pp - 1):
        g = stage.transformer.wte.weight.grad
        g.copy_(pipeline.send_recv(g, pp - 1 - s, g, pp_group))


EXERCISES = [
    Exercise("02.1", "gpipe_step", "GPipe, the lesson's loop: all forwards, then backwards", ("gpipe_step",),
             "Huang et al. 2019; Narayanan et al. 2021, Section 2.2.1 (Figure 3)", check_gpipe_step,
             lambda: {"gpipe_step": REFERENCE["gpipe_step"]},
             [Planted("gpipe_backwards_reversed", "GPipe's backwards run newest first",
                      lambda: {"gpipe_step": _gpipe_planted(newest_first=True)},
                      "GPipe runs every forward first, then the backwards in the same order"),
              Planted("gpipe_tied_not_summed", "the loop never calls sum_tied_grads",
                      lambda: {"gpipe_step": _gpipe_planted(tied=False)}, "the step never called pipeline.sum_tied_grads"),
              Planted("gpipe_means_mean", "each microbatch's mean weighs 1/m, not its share of the counted targets",
                      lambda: {"gpipe_step": _gpipe_planted(means=True)}, "the loss is the mean of the microbatches' means")]),
    Exercise("02.2", "one_f_one_b_step", "1F1B, the lesson's loop: warm-up, steady, drain", ("one_f_one_b_step",),
             "Narayanan et al. 2021, Section 2.2.1 (Figure 4, top); PipeDream-Flush (Narayanan et al. 2021, ICML)",
             check_one_f_one_b_step, lambda: {"one_f_one_b_step": REFERENCE["one_f_one_b_step"]},
             [Planted("warmup_too_long", "1F1B warms up with pp - stage forwards, one too many",
                      lambda: {"one_f_one_b_step": _one_f_one_b_planted(lambda pp, s: pp - s)}, "warm-up too long"),
              Planted("warmup_too_short", "1F1B warms up with pp - stage - 2 forwards, one too few",
                      lambda: {"one_f_one_b_step": _one_f_one_b_planted(lambda pp, s: pp - s - 2)}, "warm-up too short"),
              Planted("steady_past_the_end", "the last steady step also waits for a next microbatch's input",
                      lambda: {"one_f_one_b_step": _one_f_one_b_planted(past_end=True)}, "nothing will send it, and the rank would wait")]),
    Exercise("02.3", "sum_tied_grads", "the tied embedding's gradient across stages",
             ("sum_tied_grads",), "Shoeybi et al. 2019, Section 3 (the shared embedding)",
             check_sum_tied_grads, lambda: {"sum_tied_grads": REFERENCE["sum_tied_grads"]},
             [Planted("tied_not_summed", "the copies of the tied embedding are left as they are",
                      lambda: {"sum_tied_grads": _sum_nothing}, "it holds only its own part of the gradient"),
              Planted("tied_swapped", "each end takes the other's part instead of adding it",
                      lambda: {"sum_tied_grads": _swap_not_add}, "it holds only the other stage's part")]),
]
