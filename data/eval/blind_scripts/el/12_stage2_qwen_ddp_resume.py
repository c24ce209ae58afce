"""Stage-2 full fine-tuning of the 1.5B VLM (SigLIP + Qwen2.5-1.5B) with DDP.

The instruction mix has text-only conversations interleaved with image ones, so a
micro-batch may carry no image at all. Supports resuming from the last checkpoint
and reports VQA accuracy on a held-out set by greedy decoding.

    torchrun --nproc_per_node 8 12_stage2_qwen_ddp_resume.py --train data/mix.json \
        --vqa_val data/vqav2_val_5k.json --images /data/vlm --projector runs/s1/projector.pt --out runs/s2
"""
import argparse
import functools
import json
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, SiglipImageProcessor, SiglipVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE_INDEX, IMAGE_TOKEN_INDEX = -100, -200


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="Qwen/Qwen2.5-1.5B-Instruct")
    ap.add_argument("--vision", default="google/siglip-so400m-patch14-384")
    ap.add_argument("--projector", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--vqa_val", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--ckpt_every", type=int, default=1000)
    ap.add_argument("--eval_every", type=int, default=2000)
    return ap.parse_args()


def chat_ids(tok, role, text):
    return tok(f"<|im_start|>{role}\n{text}<|im_end|>\n", add_special_tokens=False).input_ids


class MixData(Dataset):
    def __init__(self, path, images, tok, proc, max_len):
        self.rows, self.images, self.tok, self.proc, self.max_len = json.load(open(path)), images, tok, proc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids, lab = [], []
        for t in r["conversations"]:
            role = "user" if t["from"] == "human" else "assistant"
            text = t["value"].replace("<image>", "").strip()
            piece = chat_ids(self.tok, role, text)
            if role == "user" and "<image>" in t["value"] and "image" in r:
                piece = piece[:3] + [IMAGE_TOKEN_INDEX] + piece[3:]  # after "<|im_start|>user\n"
            ids += piece
            lab += piece if role == "assistant" else [IGNORE_INDEX] * len(piece)
        px = None
        if "image" in r:
            px = self.proc(Image.open(os.path.join(self.images, r["image"])).convert("RGB"),
                           return_tensors="pt").pixel_values[0]
        return torch.tensor(ids[: self.max_len]), torch.tensor(lab[: self.max_len]), px


def collate(batch, pad_id):
    ids, lab, px = zip(*batch)
    mask = nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in ids], batch_first=True, padding_value=0)
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    lab = nn.utils.rnn.pad_sequence(lab, batch_first=True, padding_value=IGNORE_INDEX)
    px = [p for p in px if p is not None]
    return ids, mask, lab, (torch.stack(px) if px else None)


class QwenVLM(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def embed(self, ids, mask, lab, px):
        emb = self.llm.get_input_embeddings()
        feats = None
        if px is not None:
            with torch.no_grad():
                f = self.vision(px.to(torch.bfloat16)).last_hidden_state
            feats = self.projector(f)
        xs, ys, k = [], [], 0
        for b in range(ids.size(0)):
            i, l = ids[b][mask[b].bool()], lab[b][mask[b].bool()]
            pos = (i == IMAGE_TOKEN_INDEX).nonzero()
            if len(pos) == 0:
                xs.append(emb(i))
                ys.append(l)
                continue
            p = pos[0].item()
            xs.append(torch.cat([emb(i[:p]), feats[k].to(emb.weight.dtype), emb(i[p + 1:])]))
            ys.append(torch.cat([l[:p], l.new_full((feats.size(1),), IGNORE_INDEX), l[p + 1:]]))
            k += 1
        L = max(x.size(0) for x in xs)
        X = xs[0].new_zeros(len(xs), L, xs[0].size(-1))
        Y = lab.new_full((len(xs), L), IGNORE_INDEX)
        M = mask.new_zeros(len(xs), L)
        for b, (x, y) in enumerate(zip(xs, ys)):
            X[b, : x.size(0)], Y[b, : y.size(0)], M[b, : x.size(0)] = x, y, 1
        return X, M, Y

    def forward(self, ids, mask, lab, px=None):
        X, M, Y = self.embed(ids, mask, lab, px)
        return self.llm(inputs_embeds=X, attention_mask=M, labels=Y).loss

    @torch.no_grad()
    def generate(self, ids, px, **kw):
        X, M, _ = self.embed(ids, torch.ones_like(ids), torch.full_like(ids, IGNORE_INDEX), px)
        return self.llm.generate(inputs_embeds=X, attention_mask=M, **kw)


def norm(s):
    return re.sub(r"[^\w\s]", "", s.lower()).strip()


@torch.no_grad()
def vqa_eval(vlm, rows, tok, proc, images, rank, world, device):
    """Each rank decodes rows[rank::world] with the plain module; sums are reduced at the end."""
    vlm.eval()
    score = torch.zeros(2, device=device)
    for r in rows[rank::world]:
        ids = chat_ids(tok, "user", r["question"] + "\nAnswer with a single word or phrase.")
        ids = ids[:3] + [IMAGE_TOKEN_INDEX] + ids[3:] + tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
        px = proc(Image.open(os.path.join(images, r["image"])).convert("RGB"), return_tensors="pt").pixel_values
        out = vlm.generate(torch.tensor([ids], device=device), px.to(device), max_new_tokens=10, do_sample=False)
        pred = norm(tok.decode(out[0], skip_special_tokens=True))
        score[0] += min(1.0, sum(norm(a) == pred for a in r["answers"]) / 3)
        score[1] += 1
    dist.all_reduce(score)
    vlm.train()
    return (score[0] / score[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(args.llm)
    proc = SiglipImageProcessor.from_pretrained(args.vision)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    vision = SiglipVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    vlm = QwenVLM(llm, vision)
    vlm.projector.load_state_dict(torch.load(args.projector, map_location="cpu"))
    vlm.to(device)

    ds = MixData(args.train, args.images, tok, proc, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=1234)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, collate_fn=functools.partial(collate, pad_id=tok.pad_token_id))
    vqa_rows = json.load(open(args.vqa_val))

    opt = torch.optim.AdamW([p for p in vlm.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    steps_per_epoch = len(loader) // args.accum
    total = args.epochs * steps_per_epoch
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    step, start_epoch = 0, 0
    last = os.path.join(args.out, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        vlm.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        step, start_epoch = ck["step"], ck["epoch"]
        if rank == 0:
            print(f"resumed from {last} at step {step}", flush=True)

    # text-only micro-batches leave the projector out of the graph
    model = DDP(vlm, device_ids=[local_rank], find_unused_parameters=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = (step - epoch * steps_per_epoch) * args.accum
        opt.zero_grad(set_to_none=True)
        t0 = time.time()
        for it, (ids, mask, lab, px) in enumerate(loader):
            if it < skip:
                continue
            ids, mask, lab = ids.to(device), mask.to(device), lab.to(device)
            px = px.to(device) if px is not None else None
            if (it + 1) % args.accum != 0:
                with model.no_sync():
                    (model(ids, mask, lab, px) / args.accum).backward()
                continue
            loss = model(ids, mask, lab, px)
            (loss / args.accum).backward()
            nn.utils.clip_grad_norm_(vlm.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} {(time.time() - t0) / 10:.2f}s/step",
                          flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch}, last + ".tmp")
                    os.replace(last + ".tmp", last)
                dist.barrier()
            if step % args.eval_every == 0:
                acc = vqa_eval(model.module, vqa_rows, tok, proc, args.images, rank, world, device)
                if rank == 0:
                    print(f"step {step} vqa_acc {acc * 100:.2f}", flush=True)

    if rank == 0:
        model.module.llm.save_pretrained(os.path.join(args.out, "final", "llm"))
        tok.save_pretrained(os.path.join(args.out, "final", "llm"))
        torch.save(model.module.projector.state_dict(), os.path.join(args.out, "final", "projector.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
