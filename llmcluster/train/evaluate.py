"""In-loop validation loss: fixed windows every `log.eval_interval` steps and at the last step. For a data
mixture, each source is evaluated on its own validation windows (`val_loss_by_source`) and `val_loss` is
the mean over all their target tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmcluster.data.dataset import MixtureSampler, eval_batches
from llmcluster.train.parallelize import step_context


class Evaluator:
    def __init__(self, cfg, env, dims, model, pipe, autocast, dataset, sampler, events):
        self.cfg, self.env, self.model, self.pipe, self.autocast, self.events = cfg, env, model, pipe, autocast, events
        self.dp_rank, self.dp_size = dims.dp_rank(env.rank), dims.dp
        self.loss_ctx = step_context(dims, env.device)    # as in training (TP's loss_parallel, SDPA's order)
        self.interval, self.total = cfg.log.eval_interval, cfg.train.steps
        self.sources = ([(s.name, s.ds) for s in sampler.samplers] if isinstance(sampler, MixtureSampler)
                        else [(None, dataset)])

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.total

    @torch.no_grad()
    def __call__(self, step: int) -> dict:
        """{"val_loss": ..., and for a mixture "val_loss_by_source": {name: ...}} (the same on every rank)."""
        self.events.emit("eval_start", step)
        self.model.eval()
        sums = torch.stack([self._loss_sum(ds) for _, ds in self.sources])   # [sources, (loss sum, tokens)]
        if self.env.distributed:
            dist.all_reduce(sums)
        self.model.train()
        self.events.emit("eval_end", step)
        mean = lambda s: float(s[0] / s[1].clamp(min=1))  # noqa: E731
        out = {"val_loss": mean(sums.sum(0))}
        if self.sources[0][0] is not None:
            out["val_loss_by_source"] = {name: mean(s) for (name, _), s in zip(self.sources, sums)}
        return out

    def _loss_sum(self, ds) -> torch.Tensor:
        total = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        c = self.cfg
        batches = eval_batches(ds, c.data.seq_len, c.log.eval_batches, c.train.micro_batch, self.dp_rank, self.dp_size)
        if self.pipe is not None:
            return total + self._pipeline_eval(list(batches))
        for x, y in batches:
            x, y = x.to(self.env.device), y.to(self.env.device)
            with self.autocast(), self.loss_ctx():
                loss = self.model(x, y, c.train.loss_chunks)
            total += torch.stack([loss.double(), (y != -100).sum().double()])  # -100: chat data's untrained
        return total

    def _pipeline_eval(self, batches: list) -> torch.Tensor:
        """[loss sum, tokens] of the validation batches, run grad_accum at a time through the schedule's
        forward-only pass; a short last group is padded with copies whose losses are dropped."""
        total = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        m = self.pipe.n_microbatches
        for g in range(0, len(batches), m):
            group = batches[g:g + m]
            real = len(group)
            group = group + [group[-1]] * (m - real)
            x = torch.cat([b[0] for b in group]).to(self.env.device)
            y = torch.cat([b[1] for b in group]).to(self.env.device)
            with self.autocast():
                losses = self.pipe.step(x, y, train=False)
            for (_, yb), loss in zip(group[:real], losses[:real]):
                total += torch.stack([loss.double() * yb.numel(),
                                      torch.tensor(yb.numel(), dtype=torch.float64, device=self.env.device)])
        return total
