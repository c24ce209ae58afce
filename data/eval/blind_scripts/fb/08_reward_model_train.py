"""Pairwise reward model training (Bradley-Terry loss) with DeepSpeed.

torchrun --nproc_per_node 8 reward_model_train.py --config configs/rm_7b.yaml
"""
import argparse
import json
import logging
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer

log = logging.getLogger("rm")

DEFAULTS = {
    "model": "ckpt/sft-7b/hf",
    "train_file": "data/rm/train.jsonl",
    "eval_file": "data/rm/test.jsonl",
    "output_dir": "ckpt/rm-7b",
    "max_len": 1024,
    "micro_batch": 4,
    "grad_accum": 4,
    "lr": 9e-6,
    "epochs": 1,
    "warmup_steps": 50,
    "eval_steps": 250,
    "zero_stage": 2,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--override", nargs="*", default=[], help="key=value pairs")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.override:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v) if k in DEFAULTS else v
    return argparse.Namespace(**cfg)


class PairDataset(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = lambda resp: self.tok(r["prompt"] + resp, truncation=True, max_length=self.max_len)["input_ids"]
        return enc(r["chosen"]), enc(r["rejected"])


def collate_pairs(pad_id):
    def collate(batch):
        seqs = [c for c, _ in batch] + [r for _, r in batch]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return ids, mask
    return collate


def pairwise_loss(rewards):
    n = rewards.size(0) // 2
    chosen, rejected = rewards[:n], rewards[n:]
    loss = -F.logsigmoid(chosen - rejected).mean()
    acc = (chosen > rejected).float().mean()
    return loss, acc


def evaluate(engine, loader):
    engine.eval()
    agg = torch.zeros(3, device=engine.device)
    with torch.no_grad():
        for ids, mask in loader:
            r = engine(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device)).logits.squeeze(-1)
            loss, acc = pairwise_loss(r.float())
            bs = ids.size(0) // 2
            agg += torch.tensor([loss.item() * bs, acc.item() * bs, bs], device=engine.device)
    dist.all_reduce(agg)
    engine.train()
    return agg[0].item() / agg[2].item(), agg[1].item() / agg[2].item()


def main():
    cfg = load_cfg()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    tok = AutoTokenizer.from_pretrained(cfg.model)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForSequenceClassification.from_pretrained(cfg.model, num_labels=1, torch_dtype=torch.bfloat16)
    model.config.pad_token_id = tok.pad_token_id

    train_ds = PairDataset(cfg.train_file, tok, cfg.max_len)
    eval_ds = PairDataset(cfg.eval_file, tok, cfg.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=sampler, collate_fn=collate_pairs(tok.pad_token_id))
    eval_dl = DataLoader(eval_ds, batch_size=cfg.micro_batch, sampler=DistributedSampler(eval_ds, shuffle=False),
                         collate_fn=collate_pairs(tok.pad_token_id))

    total_steps = cfg.epochs * len(train_dl) // cfg.grad_accum
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": cfg.zero_stage, "overlap_comm": True},
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": cfg.warmup_steps}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    skipped = 0
    t0 = time.time()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for ids, mask in train_dl:
            rewards = engine(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device)).logits.squeeze(-1)
            loss, acc = pairwise_loss(rewards.float())
            if not torch.isfinite(loss):
                skipped += 1
                log.warning("non-finite loss on rank %d, skipping batch (%d skipped so far)", rank, skipped)
                continue
            engine.backward(loss)
            engine.step()

            if engine.is_gradient_accumulation_boundary():
                step = engine.global_steps
                if step % 10 == 0:
                    log.info("step %d/%d loss %.4f acc %.3f lr %.2e %.1fs", step, total_steps, loss.item(),
                             acc.item(), engine.get_lr()[0], time.time() - t0)
                if step % cfg.eval_steps == 0:
                    el, ea = evaluate(engine, eval_dl)
                    log.info("[eval] step %d loss %.4f acc %.4f", step, el, ea)
                    engine.save_checkpoint(cfg.output_dir, tag=f"step{step}")

    el, ea = evaluate(engine, eval_dl)
    log.info("[final eval] loss %.4f acc %.4f", el, ea)
    engine.save_checkpoint(cfg.output_dir, tag="final")
    engine.save_16bit_model(os.path.join(cfg.output_dir, "hf"))
    if rank == 0:
        tok.save_pretrained(os.path.join(cfg.output_dir, "hf"))
        engine.module.config.save_pretrained(os.path.join(cfg.output_dir, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
