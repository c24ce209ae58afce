"""TinyLLaVA-style two-stage recipe in one script: SigLIP-SO400M vision tower + Qwen2-1.5B.

  --stage pretrain : only the MLP connector is trained on caption data, saved as mm_projector.bin
  --stage finetune : connector + full LLM trained on instruction data, connector initialised
                     from the pretrain output (--pretrain-mm-adapter)

    torchrun --nproc_per_node=8 18_tinyllava_two_stage.py --stage pretrain --data /data/blip_558k.json \
        --image-folder /data/llava_pretrain/images --out ckpt/tiny_pt
    torchrun --nproc_per_node=8 18_tinyllava_two_stage.py --stage finetune --data /data/llava_665k.json \
        --image-folder /data/llava_ft_images --pretrain-mm-adapter ckpt/tiny_pt/mm_projector.bin --out ckpt/tiny_ft
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, SiglipImageProcessor, SiglipVisionModel


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", choices=["pretrain", "finetune"], required=True)
    p.add_argument("--llm", default="Qwen/Qwen2-1.5B")
    p.add_argument("--vision", default="google/siglip-so400m-patch14-384")
    p.add_argument("--data", required=True)
    p.add_argument("--image-folder", required=True)
    p.add_argument("--pretrain-mm-adapter", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-len", type=int, default=2048)
    return p.parse_args()


class ConvData(Dataset):
    def __init__(self, path, folder, tok, proc, max_len):
        self.items = [x for x in json.load(open(path)) if "image" in x]
        self.folder, self.tok, self.proc, self.max_len = folder, tok, proc, max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ex = self.items[i]
        pix = self.proc(Image.open(os.path.join(self.folder, ex["image"])).convert("RGB"),
                        return_tensors="pt").pixel_values[0]
        ids, labels = [], []
        for t in ex["conversations"]:
            text = t["value"].replace("<image>", "").strip()
            if t["from"] == "human":
                seg = self.tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").input_ids
                labels += [-100] * len(seg)
            else:
                seg = self.tok(f"{text}<|im_end|>\n").input_ids
                labels += seg
            ids += seg
        return pix, torch.tensor(ids[: self.max_len]), torch.tensor(labels[: self.max_len])


def collate(batch, pad_id):
    return (torch.stack([b[0] for b in batch]),
            nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=pad_id),
            nn.utils.rnn.pad_sequence([b[2] for b in batch], batch_first=True, padding_value=-100))


class TinyLlava(nn.Module):
    def __init__(self, vision_name, llm_name):
        super().__init__()
        self.vision_tower = SiglipVisionModel.from_pretrained(vision_name, torch_dtype=torch.bfloat16)
        self.llm = AutoModelForCausalLM.from_pretrained(llm_name, torch_dtype=torch.bfloat16)
        dv, dl = self.vision_tower.config.hidden_size, self.llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(dv, dl), nn.GELU(), nn.Linear(dl, dl))

    def forward(self, pix, ids, labels, pad_id):
        with torch.no_grad():
            feats = self.vision_tower(pix.to(torch.bfloat16), output_hidden_states=True).hidden_states[-2]
        img = self.mm_projector(feats.float())
        tok = self.llm.get_input_embeddings()(ids)
        # image tokens are prepended to the conversation
        inputs = torch.cat([img.to(tok.dtype), tok], 1)
        att = torch.cat([torch.ones(img.shape[:2], dtype=torch.long, device=ids.device), ids.ne(pad_id).long()], 1)
        lab = torch.cat([torch.full(img.shape[:2], -100, dtype=torch.long, device=ids.device), labels], 1)
        return self.llm(inputs_embeds=inputs, attention_mask=att, labels=lab).loss


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    lr = args.lr or (1e-3 if args.stage == "pretrain" else 2e-5)

    tok = AutoTokenizer.from_pretrained(args.llm)
    proc = SiglipImageProcessor.from_pretrained(args.vision)
    model = TinyLlava(args.vision, args.llm)
    model.vision_tower.requires_grad_(False)
    if args.stage == "pretrain":
        model.llm.requires_grad_(False)
    else:
        model.llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.llm.config.use_cache = False
        if args.pretrain_mm_adapter:
            weights = torch.load(args.pretrain_mm_adapter, map_location="cpu")
            model.mm_projector.load_state_dict({k.replace("mm_projector.", ""): v for k, v in weights.items()})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    ds = ConvData(args.data, args.image_folder, tok, proc, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True,
                        collate_fn=lambda b: collate(b, tok.pad_token_id), pin_memory=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    total = args.epochs * len(loader)
    warm = int(0.03 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for pix, ids, labels in loader:
            pix, ids, labels = pix.to(device), ids.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pix, ids, labels, tok.pad_token_id)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{args.stage}] step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e}",
                          flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.stage == "pretrain":
            adapter = {k: v.cpu() for k, v in model.state_dict().items() if "mm_projector" in k}
            torch.save(adapter, os.path.join(args.out, "mm_projector.bin"))
        else:
            inner = model.module
            inner.llm.save_pretrained(os.path.join(args.out, "llm"))
            tok.save_pretrained(os.path.join(args.out, "llm"))
            torch.save(inner.mm_projector.state_dict(), os.path.join(args.out, "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
