"""Apply plausible mistakes to the loss and the learner loop, one at a time, and check the tests catch each.

Each entry: a file, a line of today's code, the broken variant, and the tests that must fail on it. The file
is restored after every run (also on Ctrl-C). Run from the repository root::

    python tools/loss_mutants.py        # prints KILLED or SURVIVED per variant; exits 1 if any survived
"""

from __future__ import annotations

import os
import subprocess
import sys

MUTANTS = [
    (
        "learner/minibatch.py",
        "trainable = trainable_rows(batch, advantage, drop_uniform, mask_truncated)",
        "trainable = trainable_rows(batch, advantage, drop_uniform)",
        "tests/unit/learner/test_learner_loss_contract.py",
    ),
    (
        "learner/batch.py",
        "adv, keep = _advantages(batch, advantage, drop_uniform)\n    t_len",
        "_tr = batch.column('finish_reason').to_numpy(zero_copy_only=False) == 'length'\n    _sel = ~_tr if mask_truncated else np.ones(len(_tr), bool)\n    _, gidx = np.unique(batch.column('group_id').to_numpy(zero_copy_only=False), return_inverse=True)\n    adv, keep = group_advantages(rewards[torch.from_numpy(_sel)], torch.from_numpy(gidx.astype(np.int64))[torch.from_numpy(_sel)], advantage, drop_uniform)\n    _a = torch.zeros(len(_sel)); _a[torch.from_numpy(_sel)] = adv; adv = _a\n    _k = torch.ones(len(_sel), dtype=torch.bool); _k[torch.from_numpy(_sel)] = keep; keep = _k\n    t_len",
        "tests/unit/learner/test_learner_loss_contract.py",
    ),
    (
        "learner/losses.py",
        "kl_w = torch.exp((logp.detach() - behaviour_logp).clamp(max=LOG_RATIO_CLAMP)).clamp(max=s.tis_cap)",
        "kl_w = torch.exp((logp.detach() - behaviour_logp).clamp(max=LOG_RATIO_CLAMP))",
        "tests/unit/learner",
    ),
    (
        "learner/losses.py",
        "kl_w = torch.exp((logp.detach() - behaviour_logp).clamp(max=LOG_RATIO_CLAMP)).clamp(max=s.tis_cap)",
        "kl_w = torch.exp((old - behaviour_logp).clamp(max=LOG_RATIO_CLAMP)).clamp(max=s.tis_cap)",
        "tests/unit/learner",
    ),
    (
        "learner/losses.py",
        "return is_w * torch.where(dual_active, dual_bound, surr), ratio,",
        "return torch.where(advantages < 0, torch.minimum(is_w * surr, dual_bound), is_w * surr), ratio,",
        "tests/unit/learner",
    ),
    (
        "learner/batch.py",
        "weights=aggregation_weights(seq_lens, aggregation, total_tokens, len(rows)),",
        "weights=aggregation_weights(seq_lens, aggregation, total_tokens, len(seq_lens)),",
        "tests/unit/learner",
    ),
    (
        "learner/loop.py",
        "            parts.append(self.engine.train_step(plans[k], step_scheduler=len(parts) == n_opt - 1))",
        "            self.engine.prepare_logprobs(plans[k]) if len(parts) >= len(plans) else None\n                parts.append(self.engine.train_step(plans[k], step_scheduler=len(parts) == n_opt - 1))",
        "tests/integration/learner/test_learner_loop_contract.py",
    ),
    (
        "learner/loop.py",
        "aggregation=self.cfg.loss.effective_aggregation,\n            learner_version=self.version,",
        "aggregation=self.cfg.loss.effective_aggregation,\n            learner_version=self.version + 1,",
        "tests/integration/learner/test_learner_loop_contract.py",
    ),
    (
        "learner/losses.py",
        "    base = old\n",
        "    base = behaviour_logp if s.correction == 'none' else old\n",
        "tests/unit/learner",
    ),
    (
        "learner/losses.py",
        "            kl_val = kl_val.clamp(-KL_CLAMP, KL_CLAMP)",
        "            pass",
        "tests/unit/learner",
    ),
    # rollout correction (learner/correction.py): verl's k1 sign, TIS truncation, the kept-token denominator, bypass
    (
        "learner/correction.py",
        "        return -d\n",
        "        return d\n",
        "tests/unit/learner/test_learner_correction.py",
    ),
    (
        "learner/correction.py",
        "        return raw.clamp(max=upper)",
        "        return raw",
        "tests/unit/learner/test_learner_correction.py",
    ),
    (
        "learner/correction.py",
        "new_w[keep] = aggregation_weights(kept_lens, aggregation, t_kept, n_seqs)",
        "new_w[keep] = aggregation_weights(kept_lens, aggregation, d.numel(), n_seqs)",
        "tests/unit/learner/test_learner_correction.py",
    ),
    (
        "learner/losses.py",
        "        base = behaviour_logp\n",
        "        base = old\n",
        "tests/unit/learner/test_learner_correction.py",
    ),
]


def main() -> int:
    survived = 0
    for i, (f, old, new, tests) in enumerate(MUTANTS):
        src = open(f).read()
        assert src.count(old) == 1, (i, f, old)
        open(f, "w").write(src.replace(old, new))
        try:
            r = subprocess.run(
                [sys.executable, "-m", "pytest", tests, "-q", "-x", "-p", "no:randomly"],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": "."},
            )
            last = [l for l in r.stdout.splitlines() if "passed" in l or "failed" in l or "error" in l][-1:]
            print(i, f, "KILLED" if r.returncode else "SURVIVED", last, flush=True)
            survived += r.returncode == 0
        finally:
            open(f, "w").write(src)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
