"""The Hugging Face Space of ``memfit ui``: the same page, served by the Space's Gradio runtime
(``pip install 'memfit[ui]'`` in its requirements). Locally, ``memfit ui`` serves it."""

from memfit.ui.app import LAUNCH, build_app

# a Space is reached by anyone: the model box reads no path on its server (uploads only)
demo = build_app(local_paths=False, server=True)

if __name__ == "__main__":
    demo.launch(**LAUNCH)
