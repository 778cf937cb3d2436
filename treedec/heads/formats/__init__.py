"""Draft heads in the layouts other projects publish, one file per layout: :mod:`.read` tells a directory's layout and
converts it to a treedec head's config and state, :mod:`.write` exports a treedec head (``python -m
treedec.export_head``); :mod:`.eagle` (EAGLE-1/2), :mod:`.eagle3` (EAGLE-3 / SpecForge), :mod:`.speculators` (vLLM
speculators' EAGLE-3), :mod:`.peagle` (P-EAGLE) and :mod:`.dflash` (z-lab's DFlash) hold each layout's own
fields and checks; :mod:`.fields` what they share; :mod:`.weights` reads the weight files, never unpickling objects.
"""
