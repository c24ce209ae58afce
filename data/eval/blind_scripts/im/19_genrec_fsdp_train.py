"""
Semantic-ID seq2seq recommender (T5 blocks) sharded with FSDP.

* warm start: rank 0 reads the consolidated checkpoint, FSDP broadcasts it (sync_module_states)
* eval: exact-match hit@1 with greedy decoding of the L code tokens, run through the FSDP
  module with the same number of forward calls on every rank
* save: full state dict gathered to rank 0 (CPU offload), written by rank 0

torchrun --standalone --nproc_per_node=8 19_genrec_fsdp_train.py --data data/books --init ckpt/books_pretrain.pt
"""
import argparse
import functools
import json
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

PAD, EOS = 0, 1


class NextItemSet(Dataset):
    def __init__(self, path, sem, K, split, max_items=20):
        self.sem, self.K, self.rows = sem, K, []
        with open(path) as f:
            for line in f:
                s = json.loads(line)["items"]
                if split == "train":
                    self.rows += [(s[max(0, t - max_items):t], s[t]) for t in range(1, len(s) - 2)]
                else:
                    self.rows.append((s[-2 - max_items:-2], s[-2]))

    def ids(self, it):
        return [2 + l * self.K + int(c) for l, c in enumerate(self.sem[it])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        h, t = self.rows[i]
        return i, [x for it in h for x in self.ids(it)], self.ids(t) + [EOS]


def collate(batch):
    idx, src, tgt = zip(*batch)
    L = max(len(s) for s in src)
    x = torch.zeros(len(src), L, dtype=torch.long)
    for i, s in enumerate(src):
        x[i, :len(s)] = torch.tensor(s)
    return torch.tensor(idx), x, (x != PAD).long(), torch.tensor(tgt)


@torch.no_grad()
def greedy_hit1(model, loader, device, n_levels, K, world):
    model.eval()
    all_idx, all_hit = [], []
    for idx, src, mask, lab in loader:
        src, mask, lab = src.to(device), mask.to(device), lab.to(device)
        dec = torch.full((src.size(0), 1), PAD, dtype=torch.long, device=device)
        for l in range(n_levels):
            logits = model(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits[:, -1]
            lo = 2 + l * K
            nxt = logits[:, lo:lo + K].argmax(-1) + lo
            dec = torch.cat([dec, nxt[:, None]], 1)
        all_hit.append((dec[:, 1:] == lab[:, :n_levels]).all(-1).float())
        all_idx.append(idx.to(device))
    all_idx, all_hit = torch.cat(all_idx), torch.cat(all_hit)
    gi = torch.empty(world * all_idx.numel(), dtype=all_idx.dtype, device=device)
    gh = torch.empty(world * all_hit.numel(), dtype=all_hit.dtype, device=device)
    dist.all_gather_into_tensor(gi, all_idx)
    dist.all_gather_into_tensor(gh, all_hit)
    # the sampler repeats a few samples so that every rank gets the same count; count each once
    seen = torch.zeros(int(gi.max().item()) + 1, dtype=torch.bool, device=device)
    seen[gi] = True
    per_sample = torch.zeros_like(seen, dtype=torch.float)
    per_sample[gi] = gh
    model.train()
    return (per_sample[seen].sum() / seen.sum()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", default=None)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--bs", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", default="ckpt/books_fsdp")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sem = np.load(os.path.join(args.data, "sem_ids.npy"))
    n_levels = sem.shape[1]
    seq_file = os.path.join(args.data, "seqs.jsonl")
    train = NextItemSet(seq_file, sem, args.K, "train")
    valid = NextItemSet(seq_file, sem, args.K, "valid")
    tr_sampler = DistributedSampler(train, shuffle=True, seed=0)
    va_sampler = DistributedSampler(valid, shuffle=False)
    tr_dl = DataLoader(train, batch_size=args.bs, sampler=tr_sampler, collate_fn=collate, num_workers=4,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(valid, batch_size=256, sampler=va_sampler, collate_fn=collate, num_workers=2)

    cfg = T5Config(vocab_size=2 + n_levels * args.K, d_model=768, d_ff=3072, d_kv=64, num_layers=12,
                   num_heads=12, dropout_rate=0.1, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    model = T5ForConditionalGeneration(cfg)
    if args.init and rank == 0:
        model.load_state_dict(torch.load(args.init, map_location="cpu")["model"])
        print(f"warm start from {args.init}")

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        sync_module_states=args.init is not None,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tr_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for _, src, mask, lab in tr_dl:
            out = model(input_ids=src.to(device), attention_mask=mask.to(device), labels=lab.to(device))
            out.loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            run += torch.stack([out.loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run)
        hit1 = greedy_hit1(model, va_dl, device, n_levels, args.K, world)
        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} hit@1 {hit1:.4f}", flush=True)

        if hit1 > best:
            best = hit1
            cfg_sd = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg_sd):
                full = model.state_dict()
            if rank == 0:
                torch.save({"model": full, "epoch": epoch, "hit@1": hit1, "config": cfg.to_dict()},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
