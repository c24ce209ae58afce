"""Direct Preference Optimization on top of an SFT checkpoint (DeepSpeed ZeRO-2, bf16).

    deepspeed --num_gpus 8 dpo_train.py --sft_model ckpt/sft-7b/hf \
        --pairs data/prefs_train.jsonl --eval_pairs data/prefs_eval.jsonl --out ckpt/dpo-7b
"""
import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sft_model", required=True)
    parser.add_argument("--pairs", required=True)
    parser.add_argument("--eval_pairs", default=None)
    parser.add_argument("--out", default="ckpt/dpo")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=5e-7)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--grad_accum", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max_len", type=int, default=1024)
    parser.add_argument("--max_prompt_len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--local-rank", type=int, default=-1)
    return parser.parse_args()


class PreferencePairs(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len, self.max_prompt_len = tok, max_len, max_prompt_len

    def __len__(self):
        return len(self.rows)

    def _encode(self, prompt_ids, completion):
        c_ids = self.tok(completion, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (prompt_ids + c_ids)[: self.max_len]
        labels = ([-100] * len(prompt_ids) + c_ids)[: self.max_len]
        return ids, labels

    def __getitem__(self, i):
        r = self.rows[i]
        p_ids = self.tok(r["prompt"])["input_ids"][-self.max_prompt_len:]
        ch, ch_lab = self._encode(p_ids, r["chosen"])
        rj, rj_lab = self._encode(p_ids, r["rejected"])
        return ch, ch_lab, rj, rj_lab


def pad_batch(seqs, value):
    L = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (L - len(s)) for s in seqs], dtype=torch.long)


def make_collate(pad_id):
    def collate(batch):
        # chosen first, rejected second, concatenated along batch dim
        ids = [b[0] for b in batch] + [b[2] for b in batch]
        labels = [b[1] for b in batch] + [b[3] for b in batch]
        input_ids = pad_batch(ids, pad_id)
        attention_mask = pad_batch([[1] * len(s) for s in ids], 0)
        return input_ids, attention_mask, pad_batch(labels, -100)
    return collate


def sequence_logps(logits, labels):
    logits = logits[:, :-1].float()
    labels = labels[:, 1:].clone()
    mask = labels != -100
    labels[~mask] = 0
    lp = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1)


def dpo_loss(pi_logps, ref_logps, beta):
    n = pi_logps.size(0) // 2
    pi_ch, pi_rj = pi_logps[:n], pi_logps[n:]
    ref_ch, ref_rj = ref_logps[:n], ref_logps[n:]
    logits = beta * ((pi_ch - ref_ch) - (pi_rj - ref_rj))
    loss = -F.logsigmoid(logits).mean()
    acc = (logits > 0).float().mean()
    margin = logits.detach().mean() / beta
    return loss, acc, margin


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.sft_model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    ds = PreferencePairs(args.pairs, tok, args.max_len, args.max_prompt_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=make_collate(tok.pad_token_id),
                        num_workers=2)
    eval_loader = None
    if args.eval_pairs:
        eds = PreferencePairs(args.eval_pairs, tok, args.max_len, args.max_prompt_len)
        eval_loader = DataLoader(eds, batch_size=args.micro_batch, sampler=DistributedSampler(eds, shuffle=False),
                                 collate_fn=make_collate(tok.pad_token_id))

    policy = AutoModelForCausalLM.from_pretrained(args.sft_model, torch_dtype=torch.bfloat16)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = AutoModelForCausalLM.from_pretrained(args.sft_model, torch_dtype=torch.bfloat16)
    reference.eval().requires_grad_(False)

    total_updates = len(loader) * args.epochs // args.grad_accum
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "bf16": {"enabled": True},
        "gradient_clipping": 10.0,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": args.warmup, "total_num_steps": max(total_updates, args.warmup + 1)}},
    }
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=config)
    reference.to(engine.device)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for ids, att, labels in loader:
            ids, att, labels = ids.to(engine.device), att.to(engine.device), labels.to(engine.device)
            with torch.no_grad():
                ref_lp = sequence_logps(reference(input_ids=ids, attention_mask=att).logits, labels)
            pi_lp = sequence_logps(engine(input_ids=ids, attention_mask=att).logits, labels)
            loss, acc, margin = dpo_loss(pi_lp, ref_lp, args.beta)
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 10 == 0 and rank == 0:
                print(f"ep {epoch} step {engine.global_steps} loss {loss.item():.4f} "
                      f"acc {acc.item():.3f} margin {margin.item():.3f}", flush=True)

        if eval_loader is not None:
            engine.eval()
            sums = torch.zeros(3, device=engine.device)
            with torch.no_grad():
                for ids, att, labels in eval_loader:
                    ids, att, labels = ids.to(engine.device), att.to(engine.device), labels.to(engine.device)
                    ref_lp = sequence_logps(reference(input_ids=ids, attention_mask=att).logits, labels)
                    pi_lp = sequence_logps(engine(input_ids=ids, attention_mask=att).logits, labels)
                    l, a, _ = dpo_loss(pi_lp, ref_lp, args.beta)
                    sums += torch.stack([l.float(), a.float(), torch.ones((), device=engine.device)])
            dist.all_reduce(sums)
            if rank == 0:
                print(f"[eval] epoch {epoch} loss {(sums[0] / sums[2]).item():.4f} "
                      f"acc {(sums[1] / sums[2]).item():.3f}", flush=True)

        engine.save_checkpoint(args.out, tag=f"epoch{epoch}")

    engine.save_16bit_model(os.path.join(args.out, "hf"), "pytorch_model.bin")
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "hf"))
        engine.module.config.save_pretrained(os.path.join(args.out, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
