"""
Reward model with an optional language-modelling regulariser on the chosen response
(keeps the trunk close to the SFT model, cf. "reward model overoptimisation" tricks).

    torchrun --nproc_per_node=4 13_rm_lm_regularized.py --base gpt2-large --data data/shp_pairs
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_constant_schedule_with_warmup


class RewardModelWithLM(nn.Module):
    def __init__(self, base, lm_coef=0.0):
        super().__init__()
        self.trunk = AutoModel.from_pretrained(base)
        d = self.trunk.config.hidden_size
        v = self.trunk.config.vocab_size
        self.reward_head = nn.Linear(d, 1)
        self.lm_head = nn.Linear(d, v, bias=False)
        # start the LM head from the pretrained input embeddings (untied copy)
        self.lm_head.weight.data.copy_(self.trunk.get_input_embeddings().weight.data)
        self.lm_coef = lm_coef

    def forward(self, input_ids, attention_mask, n_chosen):
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(1) - 1
        rewards = self.reward_head(h[torch.arange(h.size(0), device=h.device), last]).squeeze(-1)
        r_c, r_r = rewards[:n_chosen], rewards[n_chosen:]
        rm_loss = -F.logsigmoid(r_c - r_r).mean()
        out = {"loss": rm_loss, "rm_loss": rm_loss.detach(), "r_chosen": r_c.detach(), "r_rejected": r_r.detach()}
        if self.lm_coef > 0:
            logits = self.lm_head(h[:n_chosen, :-1])
            tgt = input_ids[:n_chosen, 1:].masked_fill(attention_mask[:n_chosen, 1:] == 0, -100)
            lm_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=-100)
            out["loss"] = rm_loss + self.lm_coef * lm_loss
            out["lm_loss"] = lm_loss.detach()
        return out


def collate(batch, pad_id):
    seqs = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask, len(batch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="gpt2-large")
    ap.add_argument("--data", required=True, help="load_from_disk dir with chosen_ids / rejected_ids")
    ap.add_argument("--out", default="ckpt/rm_aux")
    ap.add_argument("--lm_coef", type=float, default=0.0)
    ap.add_argument("--bsz", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.pad_token = tok.eos_token
    data = load_from_disk(args.data)
    train, test = data["train"], data["test"]

    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.bsz, sampler=sampler, drop_last=True, num_workers=4,
                        collate_fn=lambda b: collate(b, tok.pad_token_id))
    test_shard = test.shard(num_shards=world, index=rank, contiguous=True)
    test_loader = DataLoader(test_shard, batch_size=args.bsz, collate_fn=lambda b: collate(b, tok.pad_token_id))

    model = RewardModelWithLM(args.base, lm_coef=args.lm_coef).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=100)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{n_params:.0f}M params, lm_coef={args.lm_coef}, {len(loader)} steps/epoch x {world} GPUs")

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        for ids, mask, n in loader:
            ids, mask = ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                out = ddp_model(ids, mask, n)
            opt.zero_grad(set_to_none=True)
            scaler.scale(out["loss"]).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 50 == 0:
                acc = (out["r_chosen"] > out["r_rejected"]).float().mean()
                s = torch.stack([out["rm_loss"].float(), acc])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} rm_loss {s[0]:.4f} acc {s[1]:.3f} "
                          f"{(time.time() - t0) / step:.2f}s/step", flush=True)

        # evaluation on each rank's shard of the test split, reduced over ranks
        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, mask, n in test_loader:
                out = model(ids.to(device), mask.to(device), n)
                tot[0] += (out["r_chosen"] > out["r_rejected"]).sum()
                tot[1] += n
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch}: test pairwise accuracy {(tot[0] / tot[1]).item():.4f}", flush=True)
            torch.save(model.state_dict(), os.path.join(args.out, f"rm_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
