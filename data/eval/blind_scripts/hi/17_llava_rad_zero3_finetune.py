"""
Stage-2 instruction tuning of a LLaVA-style radiology assistant: frozen CLIP ViT-L/14-336 vision
tower, 2-layer MLP projector (initialised from the stage-1 alignment run) and Vicuna-7B, trained
with DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 17_llava_rad_zero3_finetune.py --data data/cxr_instruct_60k.json \
        --image_folder /data/mimic-cxr-jpg/files --pretrain_mm_projector ckpt/stage1/mm_projector.bin \
        --output_dir ckpt/stage2
"""
import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig

IMAGE_TOKEN = "<image>"
IGNORE_INDEX = -100
SYSTEM = "You are a helpful radiology assistant. "


class RadVLM(nn.Module):
    def __init__(self, llm_name, vision_name, image_token_id):
        super().__init__()
        self.vision_tower = CLIPVisionModel.from_pretrained(vision_name, torch_dtype=torch.bfloat16)
        self.vision_tower.requires_grad_(False)
        self.llm = LlamaForCausalLM.from_pretrained(llm_name, torch_dtype=torch.bfloat16)
        v, h = self.vision_tower.config.hidden_size, self.llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(v, h), nn.GELU(), nn.Linear(h, h))
        self.image_token_id = image_token_id

    def encode_images(self, pixel_values):
        with torch.no_grad():
            out = self.vision_tower(pixel_values, output_hidden_states=True)
        feats = out.hidden_states[-2][:, 1:]          # penultimate layer, drop CLS
        return self.mm_projector(feats)

    def forward(self, input_ids, attention_mask, labels, pixel_values):
        img = self.encode_images(pixel_values)       # B x 576 x h
        embeds = self.llm.get_input_embeddings()(input_ids)
        # exactly one <image> placeholder per sample: splice the 576 visual tokens in its place
        new_emb, new_lab, new_att = [], [], []
        for b in range(input_ids.size(0)):
            pos = (input_ids[b] == self.image_token_id).nonzero()[0, 0]
            new_emb.append(torch.cat([embeds[b, :pos], img[b].to(embeds.dtype), embeds[b, pos + 1:]]))
            new_lab.append(torch.cat([labels[b, :pos], labels.new_full((img.size(1),), IGNORE_INDEX), labels[b, pos + 1:]]))
            new_att.append(torch.cat([attention_mask[b, :pos], attention_mask.new_ones(img.size(1)),
                                      attention_mask[b, pos + 1:]]))
        return self.llm(inputs_embeds=torch.stack(new_emb), attention_mask=torch.stack(new_att),
                        labels=torch.stack(new_lab)).loss


class CXRInstruct(Dataset):
    def __init__(self, path, image_folder, tokenizer, processor, max_len):
        with open(path) as f:
            self.items = json.load(f)
        self.image_folder, self.tok, self.proc, self.max_len = image_folder, tokenizer, processor, max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = Image.open(os.path.join(self.image_folder, it["image"])).convert("RGB")
        pix = self.proc(img, return_tensors="pt")["pixel_values"][0]
        q, a = it["conversations"][0]["value"], it["conversations"][1]["value"]
        if IMAGE_TOKEN not in q:
            q = IMAGE_TOKEN + "\n" + q
        prompt = f"{SYSTEM}USER: {q} ASSISTANT:"
        p_ids = self.tok(prompt).input_ids
        a_ids = self.tok(" " + a, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        ids = torch.tensor((p_ids + a_ids)[:self.max_len])
        lab = torch.tensor(([IGNORE_INDEX] * len(p_ids) + a_ids)[:self.max_len])
        return ids, lab, pix


def make_collate(pad_id):
    def collate(batch):
        ids, lab, pix = zip(*batch)
        ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
        lab = nn.utils.rnn.pad_sequence(lab, batch_first=True, padding_value=IGNORE_INDEX)
        return ids, lab, ids.ne(pad_id).long(), torch.stack(pix)
    return collate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--data", required=True)
    ap.add_argument("--image_folder", required=True)
    ap.add_argument("--pretrain_mm_projector", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "betas": [0.9, 0.999]}},
        "steps_per_print": 50,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # keep alive: from_pretrained partitions weights at load time

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)

    model = RadVLM(args.llm, args.vision, image_token_id)
    model.llm.resize_token_embeddings(len(tok))
    projector_state = torch.load(args.pretrain_mm_projector, map_location="cpu")
    model.mm_projector.load_state_dict({k.split("mm_projector.")[-1]: v for k, v in projector_state.items()})
    model.llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.llm.config.use_cache = False

    processor = CLIPImageProcessor.from_pretrained(args.vision)
    dataset = CXRInstruct(args.data, args.image_folder, tok, processor, args.max_len)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                        collate_fn=make_collate(tok.pad_token_id), pin_memory=True)

    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for step, (ids, lab, att, pix) in enumerate(loader):
            loss = engine(ids.to(engine.device), att.to(engine.device), lab.to(engine.device),
                          pix.to(engine.device, dtype=torch.bfloat16))
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        engine.save_checkpoint(args.output_dir, tag=f"epoch{epoch}")

    # lightweight artefact for the demo server: projector weights + tokenizer
    if rank == 0:
        projector = {f"model.mm_projector.{k}": v.detach().cpu()
                     for k, v in engine.module.mm_projector.state_dict().items()}
        torch.save(projector, os.path.join(args.output_dir, "mm_projector.bin"))
        tok.save_pretrained(args.output_dir)
    engine.save_16bit_model(args.output_dir, "pytorch_model.bin")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
