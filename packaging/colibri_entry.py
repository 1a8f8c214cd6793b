"""The packaged app's program: the desktop app (`colibri gui [MODEL]`), or the CLI after `--cli`.

`colibri` opens the window (on the last model, or the first-run choices); `colibri MODEL` opens
MODEL; `colibri --cli run MODEL -p "Hi"` runs any `colibri` command without a window; `colibri -m MODULE ARGS`
runs one of the bundle's modules as `python -m` would, for the child processes the app starts with
`sys.executable -m ...` (the first run's stand-in, app.hub.standin).
"""

import sys


def main() -> int:
    """Dispatch to the GUI or, after --cli, to the command line."""
    from app.config.runtime import prepare_process

    prepare_process()
    if len(sys.argv) > 2 and sys.argv[1] == "-m":
        import runpy

        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--cli":
        from app.cli import main as cli_main

        if sys.argv[2:3] == ["pull"]:  # the GGUF shipped in the app, instead of a download (as the first run does)
            from app.config.paths import models_dir
            from ui.first_run import bundled_models_dir, seed_from_bundle

            seed_from_bundle(bundled_models_dir(), models_dir(), lambda m: print(m, file=sys.stderr))

        return cli_main(sys.argv[2:])
    from app.commands.gui import main as gui_main

    return gui_main()


if __name__ == "__main__":
    sys.exit(main())
