"""Tool-calling SFT: adds <tool_call>/<tool_result> markers to the vocab and trains full weights.

torchrun --nproc_per_node=8 16_toolcall_sft_new_tokens.py --base HuggingFaceTB/SmolLM2-1.7B-Instruct \
    --data data/toolcalls_v3.jsonl --out ckpt/smol_tools
"""
import argparse
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

SPECIAL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_result>", "</tool_result>", "<tools>", "</tools>"]


@dataclass
class Cfg:
    base: str
    data: str
    out: str
    max_len: int = 4096
    bsz: int = 2
    accum: int = 8
    lr: float = 2e-5
    epochs: int = 3
    init_new_from_mean: bool = True


def setup_tokenizer(cfg: Cfg, rank: int):
    tok = AutoTokenizer.from_pretrained(cfg.base)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if rank == 0:
        n_added = tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
        print(f"added {n_added} special tokens -> vocab {len(tok)}", flush=True)
        tok.save_pretrained(os.path.join(cfg.out, "tokenizer"))
    return tok


def resize_embeddings(model, tok, init_from_mean):
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    new = model.get_input_embeddings().weight.shape[0]
    if init_from_mean and new > old:
        with torch.no_grad():
            for emb in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
                emb[old:] = emb[:old].mean(0, keepdim=True)


class ToolSFT(Dataset):
    def __init__(self, path, tok, max_len):
        self.ex = []
        for line in open(path):
            conv = json.loads(line)["messages"]
            ids = tok.apply_chat_template(conv, tokenize=True)[:max_len]
            # train on assistant turns only: mask everything before each assistant turn starts
            labels = [-100] * len(ids)
            for j in range(len(conv)):
                if conv[j]["role"] != "assistant":
                    continue
                start = len(tok.apply_chat_template(conv[:j], tokenize=True, add_generation_prompt=True))
                end = len(tok.apply_chat_template(conv[:j + 1], tokenize=True))
                for t in range(start, min(end, len(ids))):
                    labels[t] = ids[t]
            self.ex.append((ids, labels))

    def __len__(self):
        return len(self.ex)

    def __getitem__(self, i):
        return self.ex[i]


class Pad:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        n = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), n), self.pad_id)
        lab = torch.full((len(batch), n), -100)
        for i, (x, y) in enumerate(batch):
            ids[i, :len(x)] = torch.tensor(x)
            lab[i, :len(y)] = torch.tensor(y)
        return ids, lab, (ids != self.pad_id) | (lab != -100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    cfg = Cfg(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
    dist.barrier()

    tok = setup_tokenizer(cfg, rank)
    model = AutoModelForCausalLM.from_pretrained(cfg.base, torch_dtype=torch.bfloat16)
    resize_embeddings(model, tok, cfg.init_new_from_mean)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model.to(dev), device_ids=[local_rank])

    ds = ToolSFT(cfg.data, tok, cfg.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    dl = DataLoader(ds, batch_size=cfg.bsz, sampler=sampler, collate_fn=Pad(tok.pad_token_id),
                    num_workers=2, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = len(dl) // cfg.accum * cfg.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run_loss = time.time(), torch.zeros((), device=dev)
        for i, (ids, lab, att) in enumerate(dl):
            ids, lab, att = ids.to(dev), lab.to(dev), att.to(dev).long()
            boundary = (i + 1) % cfg.accum == 0
            with (model.no_sync() if not boundary else torch.enable_grad()):
                loss = model(input_ids=ids, attention_mask=att, labels=lab).loss / cfg.accum
                loss.backward()
            run_loss += loss.detach()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                dist.all_reduce(run_loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {run_loss.item() / 10:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/step", flush=True)
                run_loss.zero_()
                t0 = time.time()

        if rank == 0:
            model.module.save_pretrained(os.path.join(cfg.out, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(cfg.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
