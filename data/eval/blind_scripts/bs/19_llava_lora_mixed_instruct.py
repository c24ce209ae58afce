"""LLaVA-1.5 LoRA instruction tuning on the 665k mix (image and text-only
conversations).  Frozen CLIP tower, trainable projector, LoRA r=128 on the LLM,
gradient checkpointing to fit 7B + 576 image tokens at micro-batch 8.

    torchrun --nproc_per_node=8 19_llava_lora_mixed_instruct.py --data llava_v1_5_mix665k.json \
        --image-folder /data/llava --projector stage1/mm_projector.bin --out ckpt/llava-7b-lora
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE = -100
SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the human's questions.")


class MixDataset(Dataset):
    def __init__(self, path, image_folder, tok, improc, max_len=2048):
        self.rows = json.load(open(path))
        self.image_folder, self.tok, self.improc, self.max_len = image_folder, tok, improc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pix = None
        if "image" in r:
            img = Image.open(os.path.join(self.image_folder, r["image"])).convert("RGB")
            pix = self.improc(img, return_tensors="pt").pixel_values[0]
        ids = self.tok(SYSTEM, add_special_tokens=True).input_ids
        labels = [IGNORE] * len(ids)
        for t in r["conversations"]:
            v = t["value"].replace("<image>", "").strip()
            if t["from"] == "human":
                x = self.tok(" USER: " + v + " ASSISTANT:", add_special_tokens=False).input_ids
                ids, labels = ids + x, labels + [IGNORE] * len(x)
            else:
                x = self.tok(" " + v + self.tok.eos_token, add_special_tokens=False).input_ids
                ids, labels = ids + x, labels + x
        return pix, ids[:self.max_len], labels[:self.max_len]


def make_collate(pad_id):
    def collate(batch):
        pix, ids, labels = zip(*batch)
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), pad_id)
        lab = torch.full((len(ids), L), IGNORE)
        mask = torch.zeros((len(ids), L), dtype=torch.long)
        for k, (a, b) in enumerate(zip(ids, labels)):
            input_ids[k, :len(a)], lab[k, :len(b)], mask[k, :len(a)] = torch.tensor(a), torch.tensor(b), 1
        has_img = torch.tensor([p is not None for p in pix])
        images = torch.stack([p for p in pix if p is not None]) if has_img.any() else None
        return images, has_img, input_ids, lab, mask
    return collate


class LlavaLora(nn.Module):
    def __init__(self, vision, llm):
        super().__init__()
        self.vision = vision
        self.llm = llm
        v, h = vision.config.hidden_size, llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(v, h), nn.GELU(), nn.Linear(h, h))

    def forward(self, images, has_img, input_ids, labels, mask):
        embeds = self.llm.get_input_embeddings()(input_ids)
        if images is None:
            return self.llm(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
        with torch.no_grad():
            feats = self.vision(images, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(feats).to(embeds.dtype)
        N = img.shape[1]
        xs, ys, ms, j = [], [], [], 0
        for b in range(input_ids.shape[0]):
            if has_img[b]:
                # image tokens go right after the system prompt's BOS
                xs.append(torch.cat([embeds[b, :1], img[j], embeds[b, 1:]]))
                ys.append(torch.cat([labels[b, :1], labels.new_full((N,), IGNORE), labels[b, 1:]]))
                ms.append(torch.cat([mask[b, :1], mask.new_ones(N), mask[b, 1:]]))
                j += 1
            else:
                # text-only rows are right-padded to the same length
                xs.append(torch.cat([embeds[b], embeds.new_zeros(N, embeds.shape[-1])]))
                ys.append(torch.cat([labels[b], labels.new_full((N,), IGNORE)]))
                ms.append(torch.cat([mask[b], mask.new_zeros(N)]))
        return self.llm(inputs_embeds=torch.stack(xs), attention_mask=torch.stack(ms), labels=torch.stack(ys)).loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--projector", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--image-folder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--projector-lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False, model_max_length=2048)
    tok.pad_token = tok.unk_token
    improc = CLIPImageProcessor.from_pretrained(args.vision)
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)

    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    llm.config.use_cache = False
    llm.gradient_checkpointing_enable()
    llm.enable_input_require_grads()
    llm = get_peft_model(llm, LoraConfig(r=128, lora_alpha=256, lora_dropout=0.05, bias="none",
                                         task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"]))
    model = LlavaLora(vision, llm)
    model.mm_projector.load_state_dict(torch.load(args.projector, map_location="cpu"))
    model.to(device)
    # text-only batches leave the projector without gradients
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    ds = MixDataset(args.data, args.image_folder, tok, improc)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=4,
                        collate_fn=make_collate(tok.pad_token_id), drop_last=True, pin_memory=True)

    proj_params = list(model.module.mm_projector.parameters())
    lora_params = [p for n, p in model.module.llm.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": lora_params, "lr": args.lr},
                                   {"params": proj_params, "lr": args.projector_lr}], weight_decay=0.0)
    total = args.epochs * len(loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total), total)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    def save(tag):
        if rank == 0:
            path = os.path.join(args.out, tag)
            model.module.llm.save_pretrained(path)
            torch.save(model.module.mm_projector.state_dict(), os.path.join(path, "mm_projector.bin"))
        dist.barrier()

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, has_img, ids, labels, mask in loader:
            if images is not None:
                images = images.to(device, dtype=torch.bfloat16, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(images, has_img, ids.to(device), labels.to(device), mask.to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora_params + proj_params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {l.item():.4f} {(time.time() - t0) / step:.2f}s/it", flush=True)
            if step % args.save_every == 0:
                save(f"checkpoint-{step}")
    save("final")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
