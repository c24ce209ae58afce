"""
Generative retrieval with a T5-base-sized backbone under DeepSpeed ZeRO-3.

The code-token embeddings are initialised from the frozen RQ-VAE codebooks (projected
to d_model), which makes early training much more stable. With ZeRO-3 the model is
built partitioned (zero.Init), so the embedding has to be gathered before writing it.

deepspeed --num_gpus=8 09_genrec_deepspeed_zero3.py --data data/sports --rqvae artifacts/sports/rqvae.pt
"""
import argparse
import json
import os

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration

PAD, EOS, NSPEC = 0, 1, 2


class Pairs(Dataset):
    def __init__(self, path, sem, K, split, max_items):
        self.sem, self.K = sem, K
        self.data = []
        with open(path) as f:
            for line in f:
                s = json.loads(line)["items"]
                if split == "train":
                    self.data += [(s[max(0, t - max_items):t], s[t]) for t in range(1, len(s) - 2)]
                else:
                    self.data.append((s[-2 - max_items:-2], s[-2]))

    def tok(self, it):
        return [NSPEC + l * self.K + int(c) for l, c in enumerate(self.sem[it])]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        h, t = self.data[i]
        return i, [x for it in h for x in self.tok(it)], self.tok(t) + [EOS]


def collate(batch):
    idx, srcs, tgts = zip(*batch)
    L = max(len(s) for s in srcs)
    src = torch.zeros(len(srcs), L, dtype=torch.long)
    for i, s in enumerate(srcs):
        src[i, :len(s)] = torch.tensor(s)
    return torch.tensor(idx), src, (src != PAD).long(), torch.tensor(tgts)


def build_ds_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": args.warmup, "total_num_steps": args.total_steps}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


@torch.no_grad()
def evaluate(engine, loader, device, n_levels, beams, world):
    """All ranks must run generate() the same number of times under ZeRO-3 (synced_gpus)."""
    engine.eval()
    idx_all, hit_all = [], []
    for idx, src, mask, labels in loader:
        src, mask, labels = src.to(device), mask.to(device), labels.to(device)
        out = engine.module.generate(input_ids=src, attention_mask=mask, num_beams=beams,
                                     num_return_sequences=beams, max_new_tokens=n_levels + 1,
                                     synced_gpus=True)
        cand = out[:, 1:n_levels + 1].reshape(src.size(0), beams, n_levels)
        match = (cand == labels[:, None, :n_levels]).all(-1)
        hit_all.append(torch.stack([match[:, :5].any(-1), match[:, :10].any(-1)], -1).float())
        idx_all.append(idx.to(device))
    idx_all, hit_all = torch.cat(idx_all), torch.cat(hit_all)
    # DistributedSampler pads with repeated samples: gather per-sample results, keep each index once
    g_idx = [torch.empty_like(idx_all) for _ in range(world)]
    g_hit = [torch.empty_like(hit_all) for _ in range(world)]
    dist.all_gather(g_idx, idx_all)
    dist.all_gather(g_hit, hit_all)
    g_idx, g_hit = torch.cat(g_idx), torch.cat(g_hit)
    uniq, first = np.unique(g_idx.cpu().numpy(), return_index=True)
    res = g_hit[torch.from_numpy(first).to(device)].mean(0)
    engine.train()
    return {"recall@5": res[0].item(), "recall@10": res[1].item(), "n": len(uniq)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--rqvae", required=True)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--micro_bs", type=int, default=32)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--beams", type=int, default=10)
    ap.add_argument("--out", default="ckpt/genrec_z3")
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    sem = np.load(os.path.join(args.data, "sem_ids.npy"))
    n_levels = sem.shape[1]
    train = Pairs(os.path.join(args.data, "seqs.jsonl"), sem, args.K, "train", 20)
    valid = Pairs(os.path.join(args.data, "seqs.jsonl"), sem, args.K, "valid", 20)
    tr_sampler = DistributedSampler(train, shuffle=True, seed=0)
    va_sampler = DistributedSampler(valid, shuffle=False)
    tr_dl = DataLoader(train, batch_size=args.micro_bs, sampler=tr_sampler, collate_fn=collate,
                       num_workers=4, drop_last=True)
    va_dl = DataLoader(valid, batch_size=64, sampler=va_sampler, collate_fn=collate, num_workers=2)
    args.total_steps = args.epochs * len(tr_dl) // args.grad_accum
    ds_config = build_ds_config(args, world)

    cfg = T5Config(vocab_size=NSPEC + n_levels * args.K, d_model=768, d_ff=3072, d_kv=64, num_layers=12,
                   num_heads=12, dropout_rate=0.1, pad_token_id=PAD, eos_token_id=EOS,
                   decoder_start_token_id=PAD, tie_word_embeddings=False)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = T5ForConditionalGeneration(cfg)

    # codebooks of the frozen tokenizer: list of (K, e_dim); the collision level keeps its random init
    rq_state = torch.load(args.rqvae, map_location="cpu")["state_dict"]
    books = [rq_state[f"rq.books.{l}.weight"] for l in range(n_levels - 1)]
    emb = model.get_input_embeddings()
    with deepspeed.zero.GatheredParameters(emb.weight, modifier_rank=0):
        if rank == 0:
            g = torch.Generator().manual_seed(0)
            for l, book in enumerate(books):
                proj = torch.randn(book.size(1), cfg.d_model, generator=g) / book.size(1) ** 0.5
                lo = NSPEC + l * args.K
                emb.weight.data[lo:lo + args.K] = (book @ proj).to(emb.weight.dtype)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        run = torch.zeros(2, device=device)
        for _, src, mask, labels in tr_dl:
            loss = engine(input_ids=src.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
            engine.backward(loss)
            engine.step()
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run)
        m = evaluate(engine, va_dl, device, n_levels, args.beams, world)
        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} R@5 {m['recall@5']:.4f} "
                  f"R@10 {m['recall@10']:.4f} (n={m['n']})", flush=True)
        # collective: every rank writes its own ZeRO shard
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"recall@10": m["recall@10"]})
        if m["recall@10"] > best:
            best = m["recall@10"]
            engine.save_16bit_model(os.path.join(args.out, "best_16bit"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
